"""The mLSTM kernels' tile configurations: the candidates tuning times per head shape and dtype,
the defaults, and what fits sm_90's shared memory. Keys: L (chunk length), BV (DV tile of the
per-chunk kernels), BK x BVS (state tile of the scans), BKQ (the sliced forward's DQK slice),
DVS / DKS (the split backward's DV / DK tiles), LF (the scan issues loads first), warps, stages."""
from __future__ import annotations

import functools

import torch

from torch_xaccel.runtime import interpreting

from ..limits import SHARED_LIMIT

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256, 512)


def padded(D: int) -> int | None:
    """The head dim the kernels run D at: the smallest of HEAD_DIMS >= D (a head dim between them
    runs at that size with its extra columns masked and its state tiles past them skipped:
    triton_kernels._padding), or None above them."""
    return next((d for d in HEAD_DIMS if d >= D), None)


INTERPRETER_CONFIG = dict(L=16, BV=16, BK=16, BVS=16, warps=4, stages=1)


def fit(cfg: dict, DK: int, DV: int) -> dict:
    out = dict(cfg)
    for key, dim in (("BV", DV), ("BK", DK), ("BVS", DV), ("BKQ", DK), ("DVS", DV), ("DKS", DK)):
        if key in cfg:
            out[key] = min(dim, cfg[key])
    return out


def fitted(cfgs, DK: int, DV: int) -> list[dict]:
    """The configs fitted to the head dims, each once."""
    return unique([fit(c, DK, DV) for c in cfgs])


def scan_warps(cfg: dict) -> int:
    """Warps of the sequential state scans: at most 4. At 8 warps the scans spill no registers on
    sm_90 (at 4 they spill 584 B per program) but are slower at both benchmark shapes, forward and
    backward, the row-factor reverse scan included; so are BK 32 scan tiles (twice the programs;
    docs/benchmarks.md's git history)."""
    return min(cfg["warps"], 4)


WIDE_DK = 512  # from this DQK on, the [L, DQK] tiles need the smaller configs below


SLICED = dict(L=64, BV=128, BK=64, BVS=128, warps=4, stages=3, BKQ=64)
# the output kernel that walks DQK in BKQ-wide slices, with q.n in its own unpipelined loop: with
# q.n inside the dot loop the kernel comes out wrong in bf16 at DQK 256/512 on Hopper while the
# interpreter agrees (suspect: triton-lang/triton#6691), which is why the tuner checks newer
# variants against an original config (triton_kernels._fastest). As it is, it matches the fp64
# reference as closely as the whole-tile kernel, and it is the default forward below DQK 512: the
# fastest at both benchmark shapes (docs/benchmarks.md).


def forward_shared_bytes(cfg: dict, DK: int, DV: int, itemsize: int) -> int:
    """Shared memory of the output kernel. Whole-tile: q and k [L, DK], the entering state
    [DK, BV] and v [L, BV] in the input dtype, plus scratch; within 2 KB of what Triton asked on
    sm_90: bf16 131584 B at 128/128 L128 x BV128, 205312 B at DQK 512 L64 x BV64; fp32 at DQK
    512 410 KB (L64 x BV64) and 270 KB (L32 x BV64). Sliced (BKQ): q and k [L, BKQ] and the state
    slice [BKQ, BV]. In bf16/fp16 once whatever the stages (sm_90: 32768 B at L64 x BKQ64 x BV128,
    49152 at L128, 65536 at BKQ128, 24576 at BV64; 20480 asked at L32: the estimate is safe); in
    fp32 Triton multi-buffers them, so once per stage (Triton 3.9: 131072 B at 3 stages, 196608
    with TF32, 262144 at 4 stages or BKQ128)."""
    if cfg.get("BKQ"):
        buffers = cfg["stages"] if itemsize > 2 else 1
        return itemsize * buffers * (2 * cfg["L"] * cfg["BKQ"] + cfg["BKQ"] * cfg["BV"]) + 2048
    return itemsize * (2 * cfg["L"] * DK + DK * cfg["BV"] + cfg["L"] * cfg["BV"]) + 2048


def unique(cfgs: list[dict]) -> list[dict]:
    """Drop configs that fit made equal (e.g. BVS 128 and 64 at DV 64): each would compile and
    be timed again."""
    out = []
    for c in cfgs:
        if c not in out:
            out.append(c)
    return out


def forward_candidates(DK: int, DV: int, itemsize: int = 2) -> list[dict]:
    """Configs timed once per shape class: chunk length L, DV tile of the output kernel (BV),
    DQK slice of the output kernel (BKQ, the SLICED kernel; absent: whole DQK tiles), state tile
    of the scan (BK x BVS), warps (the scans': scan_warps) and pipeline stages, less those whose
    tiles exceed shared memory for the input's itemsize. The first is the default: below DQK 512
    the sliced kernel (SLICED), then its LF and 2-stage variants; its other neighbours (4 stages,
    8 warps, BV 64, BKQ 32/128, L 32/128: sliced_sweep_configs) are slower and not candidates.
    The whole-tile runners-up stay, since they win at small shapes (a scan tile BVS 64 loses
    everywhere and is not one). DQK 512: whole-tile L128 x BV128 asks 426 KB; L64 x BV64 fits in
    bf16/fp16 (205 KB) and is the default, the sliced kernel being untimed there. LF: the
    chunk-state scan issues each step's loads before its stores; a candidate, not the default,
    as the tuner picks it at the 7B heads and the model's shape but not at 128/128. fp32 doubles
    every tile: where none of these fits, smaller configs take their place; where none of those
    fits either, the op runs its reference."""
    whole = dict(L=128, BV=128, BK=64, BVS=128, warps=8, stages=2)
    if DK >= WIDE_DK:
        whole = dict(whole, L=64, BV=64)
        listed = [whole, SLICED, dict(SLICED, warps=8, stages=2)]
    else:
        listed = [SLICED, dict(SLICED, LF=1), dict(SLICED, stages=2), whole, dict(whole, L=64)]

    def fitting(cfgs):
        return [c for c in fitted(cfgs, DK, DV)
                if forward_shared_bytes(c, DK, DV, itemsize) <= SHARED_LIMIT]
    return fitting(listed) or fitting([dict(whole, L=64, BV=64), dict(whole, L=32, BV=32, warps=4),
                                       dict(whole, L=16, BV=64, warps=4)])


def sliced_sweep_configs(DK: int, DV: int) -> list[dict]:
    """Neighbours of SLICED for benchmarks/mlstm_sweep.py --sliced (stages, warps, tiles)."""
    s = SLICED
    return fitted((s, dict(s, stages=2), dict(s, stages=4), dict(s, warps=8), dict(s, BV=64), dict(s, BKQ=128),
                    dict(s, BKQ=32), dict(s, L=32), dict(s, L=128, warps=8, stages=2)), DK, DV)


_FP32_BWD = dict(BK=64, BVS=128, stages=2)
# fp32 per-chunk backward kernels that fit sm_90's shared memory at DV 512 (compile report, Triton
# 3.6; untimed): DQK 256 L32 x BV32 at 8 warps 147 KB, L16 x BV32 at 4 warps 105 KB; DQK 512
# L16 x BV32 204 KB. Below DQK 256 the bf16 list fits (128/128 L64 x BV32: 139 KB).
FP32_BACKWARD = {256: [dict(_FP32_BWD, L=32, BV=32, warps=8), dict(_FP32_BWD, L=16, BV=32, warps=4)],
                 512: [dict(_FP32_BWD, L=16, BV=32, warps=4)]}


SPLIT3 = dict(L=64, BV=64, BK=64, BVS=128, warps=4, stages=2, DVS=64, DKS=128)
# the backward in three per-chunk kernels: dv per DVS-wide DV tile (mlstm_bwd_dv), the gates and
# dS per chunk (mlstm_bwd_ds; only [L, L] tiles live), dq and dk per DKS-wide DK tile
# (mlstm_bwd_dqdk, two [L, DKS] accumulators: at 4 warps they spill a little on sm_90, at 8 warps
# they do not but are slower). With its DVS 128 variant the runner-up to SPLIT2, faster than dv
# alone split off or the single per-chunk kernel; DKS 32 or 64, 3 stages and L128 are slower and
# not candidates (measured: docs/benchmarks.md's git history). The reverse scan also reads every stored chunk
# state for the forget term; moved into the dv kernel, that term is slower.


SPLIT2 = dict(L=64, BV=64, BK=64, BVS=128, warps=4, stages=2, DKS=128)
# the backward in two per-chunk kernels: dv and dS in one program per chunk (mlstm_bwd_ds, DV
# walked in BV tiles), then dq and dk per DKS-wide DK tile. Every backward kernel is memory-bound;
# SPLIT3's dv kernel reads q and k once per DV tile and its gates kernel reads q, k, v and dh
# again: this reads them once per chunk (120 KB per chunk against 216 KB at 128/128, 520 KB
# against 1160 KB at the 7B heads). The default: the fastest backward at both benchmark shapes
# (docs/benchmarks.md). Its kernels keep live ranges short (templates): q.n and k.dn taken before
# the DV loop, dh entering the dots as loaded with 1/N applied outside the loop, dS stored
# pre-scaled so that dq's intra dot adds into its accumulator. Slower, so not candidates: 8 warps,
# BV 32 or 128; the scan's forget term exp(g + m) <dC, C> in the dq/dk kernel (as in SPLIT3's dv
# kernel); A or q k^T rebuilt after the DV loop; dq/dk starting from the intra dots with u folded
# into v; the reverse scan's loads before its stores; scan tiles BK 128 at 8 warps or BVS 64; scan
# stages 1 or 3. Triton 3.9's ptxas report (compile_report.py) counts more spills for the faster
# configs: spill counts there do not predict Triton 3.6's speed on the GPU.


SPLIT_MIN_DK = 64
# Below this DQK, Triton 3.6 on sm_90 miscompiles the split dq/dk kernel (mlstm_bwd_dqdk) in
# bf16 and fp16 (wrong dk, or dq when dk's dot is rewritten; some variants fault on an illegal
# address), while the interpreter computes it right; the single per-chunk kernel and dv split off
# alone are right there (tests/mlstm/test_gpu_kernels).


def backward_candidates(DK: int, DV: int, itemsize: int = 2, kept: bool = False) -> list[dict]:
    """Same keys, plus DVS (dv in its own kernel, one program per chunk and DVS-wide DV tile) and DKS (dq
    and dk in theirs, one program per chunk and DKS-wide DK tile; without DVS, SPLIT2). kept: the
    backward reads the forward's kept chunk-64 states (no scan of its own). In bf16/fp16 from DQK 64
    (SPLIT_MIN_DK) below 512 the first is SPLIT2 (the fastest at both benchmark shapes), then SPLIT3
    and its DVS 128 variant (the runners-up), then the single per-chunk kernel (chunk 64, DV tile
    32), which stays the tuner's agreement reference. At DQK 512 that kernel's L64 x BV32 asks 290
    KB of shared memory on sm_90 (over the 227 KB limit), and so does SPLIT2's dv-and-dS kernel
    (245760 B: q and k [L, DQK] beside v and dh); chunks of 32 and 16 fit the single kernel, but
    cannot read kept chunk-64 states. So at DQK 512 with kept states SPLIT3 alone (DVS 128 first,
    both at chunk 64), without them (a padded head, whose states are not kept) the chunk-32 kernel
    first, then chunk 16 and SPLIT3, the tuner choosing. fp32 from DQK 256: FP32_BACKWARD. fp32
    below: the single per-chunk kernel first (the default), then SPLIT2 and SPLIT3. They fit sm_90
    at DQK 128 (H100, Triton 3.6: mlstm_bwd_ds 229376 B of shared memory with 3xTF32 dots, 180224
    B with TF32; mlstm_bwd_dqdk 163840 / 196608 B) and SPLIT2 is the fastest there with 3xTF32
    dots (0.88 ms against the single kernel's 1.04 at B4 NH8 S1024), the single kernel with TF32
    dots (0.54 against 0.77). The BV 64 / DVS 64 config at 8 warps asks 245760 B with TF32 dots
    (over the limit; 3xTF32 fits): the tuner skips it there."""
    if itemsize > 2 and DK >= 256:
        return fitted(FP32_BACKWARD[min(DK, WIDE_DK)], DK, DV)
    if DK >= WIDE_DK:
        split = [dict(SPLIT3, DVS=128), SPLIT3] if itemsize <= 2 else []
        if kept:
            return fitted(split, DK, DV)
        base = dict(L=32, BV=64, BK=64, BVS=128, warps=8, stages=2)
        return fitted([base, dict(base, L=16, warps=4)] + split, DK, DV)
    split = [SPLIT2, SPLIT3, dict(SPLIT3, DVS=128)] if DK >= SPLIT_MIN_DK else []
    base = dict(L=64, BV=32, BK=64, BVS=128, warps=8, stages=2)
    original = [base, dict(base, warps=4), dict(base, BV=64, DVS=64)]
    if itemsize > 2:  # fp32 (DQK 64-128): the original kernel stays the default, the split ones follow
        return fitted(original + split, DK, DV)
    return fitted(split + original, DK, DV)


def forward_config(DK: int, DV: int, itemsize: int = 2) -> dict | None:
    """The default forward config, or None where none fits shared memory (the op then runs its
    reference)."""
    if interpreting():
        return fit(INTERPRETER_CONFIG, DK, DV)
    return next(iter(forward_candidates(DK, DV, itemsize)), None)


def backward_config(DK: int, DV: int, itemsize: int = 2, kept: bool = False) -> dict | None:
    if interpreting():
        return fit(INTERPRETER_CONFIG, DK, DV)
    return next(iter(backward_candidates(DK, DV, itemsize, kept)), None)


def at_chunk(configs, chunk: int):
    """A saving forward's config function (forward_config or forward_candidates) with every
    config at the kept states' chunk length, those that fit: the states and row terms it keeps
    are then the ones a backward walking that chunk reads."""
    def at_chunk(DK: int, DV: int, itemsize: int = 2):
        got = configs(DK, DV, itemsize)
        cfgs = got if isinstance(got, list) else [got] if got else []
        fit = unique([c for c in (dict(c, L=chunk) for c in cfgs)
                       if forward_shared_bytes(c, DK, DV, itemsize) <= SHARED_LIMIT])
        return fit if isinstance(got, list) else next(iter(fit), None)
    return at_chunk


@functools.lru_cache(maxsize=None)
def any_config_fits(phase: str, DK: int, DV: int, itemsize: int) -> bool:
    """Decided once per head shape and dtype size (every call of the op asks)."""
    return bool((forward_candidates if phase == "fwd" else backward_candidates)(DK, DV, itemsize))


def saving_forward_fits(DK: int, DV: int, itemsize: int, chunk_size: int) -> bool:
    """Whether a saving forward at chunk_size fits (shared memory) for these head dims and dtype."""
    return chunk_size in CHUNKS and at_chunk(forward_config, chunk_size)(DK, DV, itemsize) is not None


CHUNKS = (16, 32, 64, 128)  # chunk lengths the kernels take (the kept states' chunk_size among them)
