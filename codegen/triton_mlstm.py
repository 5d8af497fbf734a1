"""Generated Triton kernels for xaccel::mlstm (forward, backward) and xaccel::mlstm_step, rendered
from templates/mlstm_*.py.jinja per input dtype (and initial state or not, where it matters);
head dims, chunk length and tiles are compile-time constants.

The chunkwise form is split so that only the state scans are sequential: the state entering every
chunk (mlstm_chunk_states) and then every chunk's output in parallel (mlstm_fwd); the backward adds
mlstm_bwd_rows (per-row normalizer terms), the reverse state-gradient scan (mlstm_bwd_states) and
mlstm_bwd (every chunk's gradients in parallel). Configs are tuned once per shape class (_tuned).
A split scan (per-chunk contributions in parallel, then an elementwise scan) and a persistent
output kernel were tried and lost on the H200 (see docs/benchmarks.md)."""
from __future__ import annotations

import contextvars
import functools
import hashlib

import torch

from torch_xaccel.config import tuning_enabled

from . import cache
from .triton_launch import DirectLaunch
from .cache import SHARED_LIMIT
from .offsets import INT32_LIMIT, reach
from .render import _ENV, template_digest

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256, 512)
_KERNELS: dict = {}


def _render(template: str, dtype: torch.dtype, s_constexpr: bool, **extra) -> tuple[str, str]:
    """(kernel name, source) of one mLSTM template for the dot dtype. s_constexpr: sequence length
    and chunk count as compile-time constants, for Triton 3.6's interpreter (it cannot loop to a
    run-time bound under NumPy 2)."""
    tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not cache.interpreting()
    precision = "tf32" if tf32 else "ieee"
    key = f"{template}|{dtype}|{precision}|{s_constexpr}|{sorted(extra.items())}"
    name = template.split(".")[0] + "_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    src = _ENV.get_template(template).render(kernel_name=name, dot_dtype=str(dtype), precision=precision,
                                             s_constexpr=s_constexpr, **extra)
    return name, src


def _kernel(template: str, dtype: torch.dtype, **extra):
    key = (template, dtype, cache.interpreting(), tuple(sorted(extra.items())))
    if key not in _KERNELS:
        name, src = _render(template, dtype, cache.interpreting(), **extra)
        _KERNELS[key] = getattr(cache.load_source(name, src), name)
    return _KERNELS[key]


_WARMUP = contextvars.ContextVar("xaccel_mlstm_warmup", default=False)


def _launch(kernel, grid, *args, **meta):
    """kernel[grid](*args, **meta), or only its compile while tuning precompiles candidates."""
    if _WARMUP.get():
        kernel.run(*args, grid=grid, warmup=True, **meta)
    else:
        kernel[grid](*args, **meta)


def _warmup(launch, cfg) -> None:
    """Compile every kernel of one phase for `cfg` without launching any (the torch ops between
    them still run, on uninitialised buffers)."""
    token = _WARMUP.set(True)
    try:
        launch(cfg)
    finally:
        _WARMUP.reset(token)


INTERPRETER_CONFIG = dict(L=16, BV=16, BK=16, BVS=16, warps=4, stages=1)


def _fit(cfg: dict, DK: int, DV: int) -> dict:
    out = dict(cfg)
    for key, dim in (("BV", DV), ("BK", DK), ("BVS", DV), ("BKQ", DK), ("DVS", DV), ("DKS", DK)):
        if key in cfg:
            out[key] = min(dim, cfg[key])
    return out


def _fitted(cfgs, DK: int, DV: int) -> list[dict]:
    """The configs fitted to the head dims, each once."""
    return _unique([_fit(c, DK, DV) for c in cfgs])


def _scan_warps(cfg: dict) -> int:
    """Warps of the sequential state scans: at most 4. Scans at 8 warps (no register spills at
    sm_90, against 584 B per program at 4) were timed on the H200 and lost at both head shapes:
    forward 1.56 vs 1.35 ms (128/128) and 2.50 vs 1.97 ms (256/512), backward 6.61 vs 5.52 and
    8.52 vs 6.59 ms. Again on the row-factor scan (twelfth session, backward from kept states):
    the reverse scan 1.22 vs 0.70 ms and 2.20 vs 1.29 ms; BK 32 tiles (twice the programs) 1.25
    and 1.69 ms."""
    return min(cfg["warps"], 4)


WIDE_DK = 512  # from this DQK on, the [L, DQK] tiles need the smaller configs below


SLICED = dict(L=64, BV=128, BK=64, BVS=128, warps=4, stages=3, BKQ=64)
# the output kernel that walks DQK in BKQ-wide slices, with q.n in its own unpipelined loop (the
# first version had it inside the dot loop and was wrong in bf16 at DQK 256/512 on the H200, off
# by 2.5-5.4e-2, while the interpreter agreed to 1e-6; suspect triton-lang/triton#6691). This
# version matched the fp64 reference on the H200 at DQK 256 and 512 (bf16 h 2.3-2.4e-3, the
# whole-tile kernel's figure) and was the fastest forward: 1.116 against 1.334 ms at B8 NH16
# S8192 128/128, 1.822 against 1.961 ms at the 7B head shape (Triton 3.6, 2026-11-30).


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


def _unique(cfgs: list[dict]) -> list[dict]:
    """Drop configs that _fit made equal (e.g. BVS 128 and 64 at DV 64): each would compile and
    be timed again."""
    out = []
    for c in cfgs:
        if c not in out:
            out.append(c)
    return out


def forward_candidates(DK: int, DV: int, itemsize: int = 2) -> list[dict]:
    """Configs timed once per shape class: chunk length L, DV tile of the output kernel (BV),
    DQK slice of the output kernel (BKQ, the SLICED kernel; absent: whole DQK tiles), state tile
    of the scan (BK x BVS), warps (the scans': _scan_warps) and pipeline stages, less those whose
    tiles exceed shared memory for the input's itemsize. The first is the default: below DQK 512
    the sliced kernel (the fastest at both benchmark shapes, see SLICED; at 2 stages 1.094 ms at
    128/128, 1.850 at 256/512; 4 stages, 8 warps, BV64, BKQ 32/128, L32/128 were slower:
    1.16-2.38 ms); the whole-tile runners-up stay (they won at small shapes; 1.33 ms at 128/128
    and 1.96 ms at 256/512 for the first; the scan tile BVS 64 lost everywhere). DQK 512:
    whole-tile L128 x BV128 asks 426 KB; L64 x BV64 fits in bf16/fp16 (205 KB) and stays the
    default until the sliced one is timed there. LF: the chunk-state scan issues each step's
    loads before its stores (the tuner's pick at the 7B heads, 1.500 against 1.552 ms kept, and at
    the model's B4 S2048, 0.409 against 0.419; 0.976 against 0.965 at 128/128). fp32 doubles
    every tile: where none of these fits, smaller configs take their place; where none of those
    fits either, the op runs its reference."""
    whole = dict(L=128, BV=128, BK=64, BVS=128, warps=8, stages=2)
    if DK >= WIDE_DK:
        whole = dict(whole, L=64, BV=64)
        listed = [whole, SLICED, dict(SLICED, warps=8, stages=2)]
    else:
        listed = [SLICED, dict(SLICED, LF=1), dict(SLICED, stages=2), whole, dict(whole, L=64)]

    def fitting(cfgs):
        return [c for c in _fitted(cfgs, DK, DV)
                if forward_shared_bytes(c, DK, DV, itemsize) <= SHARED_LIMIT]
    return fitting(listed) or fitting([dict(whole, L=64, BV=64), dict(whole, L=32, BV=32, warps=4),
                                       dict(whole, L=16, BV=64, warps=4)])


def sliced_sweep_configs(DK: int, DV: int) -> list[dict]:
    """Neighbours of SLICED for benchmarks/mlstm_sweep.py --sliced (stages, warps, tiles)."""
    s = SLICED
    return _fitted((s, dict(s, stages=2), dict(s, stages=4), dict(s, warps=8), dict(s, BV=64), dict(s, BKQ=128),
                    dict(s, BKQ=32), dict(s, L=32), dict(s, L=128, warps=8, stages=2)), DK, DV)


_FP32_BWD = dict(BK=64, BVS=128, stages=2)
# fp32 per-chunk backward kernels that fit sm_90's shared memory at DV 512 (compile report, Triton
# 3.6, not yet run on a GPU): DQK 256 L32 x BV32 at 8 warps 147 KB, L16 x BV32 at 4 warps 105 KB;
# DQK 512 L16 x BV32 204 KB. Below DQK 256 the bf16 list fits (128/128 L64 x BV32: 139 KB).
FP32_BACKWARD = {256: [dict(_FP32_BWD, L=32, BV=32, warps=8), dict(_FP32_BWD, L=16, BV=32, warps=4)],
                 512: [dict(_FP32_BWD, L=16, BV=32, warps=4)]}


SPLIT3 = dict(L=64, BV=64, BK=64, BVS=128, warps=4, stages=2, DVS=64, DKS=128)
# the backward in three per-chunk kernels: dv per DVS-wide DV tile (mlstm_bwd_dv), the gates and
# dS per chunk (mlstm_bwd_ds; only [L, L] tiles live), dq and dk per DKS-wide DK tile
# (mlstm_bwd_dqdk, two [L, DKS] accumulators; at 4 warps both still spill 0.7-2 KB at sm_90, at
# 8 warps they do not, and lose: 5.16 / 6.60 ms). The fastest backward on the H200 (Triton 3.6,
# 2026-11-30): 4.09 ms at B8 NH16 S8192 128/128 and 6.00 ms at the 7B head shape, against 4.97
# and 6.72 for dv alone split off and 5.21 / 6.63 for the single per-chunk kernel; DKS 64: 4.27 /
# 6.28, DVS 128 (DKS 64): 4.24 / 6.15, 3 stages 4.23 / 6.14, DKS 32 4.76 / 6.87, L128 12.0 / 9.2.
# The reverse scan it runs (0.99 / 1.93 ms, profiled before the split) also reads every stored
# chunk state for the forget term; moving that to the dv kernel lost on the H200 (seventh
# session: 4.22 / 6.14 against 4.06-4.11 / 5.89-6.00 ms for SPLIT3 and its DVS 128 variant).


SPLIT2 = dict(L=64, BV=64, BK=64, BVS=128, warps=4, stages=2, DKS=128)
# the backward in two per-chunk kernels: dv and dS in one program per chunk (mlstm_bwd_ds, DV
# walked in BV tiles), then dq and dk per DKS-wide DK tile. Every backward kernel is memory-bound
# on the H200; SPLIT3's dv kernel reads q and k once per DV tile and its
# gates kernel reads q, k, v and dh again: this reads them once per chunk (at B8 NH16 S8192
# 128/128, 120 KB per chunk against 216 KB; at the 7B heads 520 KB against 1160 KB). Backward from
# kept states on the H200 (Triton 3.6, twelfth session): 3.022 / 3.876 ms against SPLIT3's 3.166 /
# 4.280; at 8 warps 4.27 / 4.29, BV 32 3.27 / 4.36. The scan's forget term exp(g + m) <dC, C>
# moved into the dq/dk kernel lost (3.28-3.35 / 4.20-4.23), as in SPLIT3's dv kernel (DGV).
# Thirteenth session, live ranges cut in the split kernels (templates): q.n and k.dn taken before
# the DV loop (the per-chunk kernel 1.15 -> 0.99 ms), dh entering the dots as loaded with 1/N
# applied outside the loop (-> 0.91 ms; in dq/dk too), dS stored pre-scaled so that dq's intra
# dot adds into its accumulator: 2.74 / 3.57 ms, 0.99 at the model's B4 NH8 S2048, where SPLIT2
# now also wins (SPLIT3 DVS 128: 1.12). Lost and not kept: A rebuilt after the DV loop (2.90 /
# 3.73), q k^T too (3.03 / 3.98), dq/dk starting from the intra dots with u folded into v (3.37 /
# 4.25), the reverse scan's loads before its stores (2.85 / 3.77), scan tiles BK 128 at 8 warps
# (3.34 / 4.55) or BVS 64 (3.03 / 4.12), scan stages 1 or 3 (no gain), 8 warps (3.75 / 3.96), BV
# 128 (3.28 / 4.00). Triton 3.9's ptxas report (compile_report.py) counted more spills for the
# winners: spills there do not predict Triton 3.6 on the H200.


def backward_candidates(DK: int, DV: int, itemsize: int = 2) -> list[dict]:
    """Same keys, plus DVS (dv in its own kernel, one program per chunk and DVS-wide DV tile)
    and DKS (dq and dk in theirs, one program per chunk and DKS-wide DK tile; without DVS, SPLIT2).
    Below DQK 512 in bf16/fp16 the first is SPLIT2 (the fastest at both benchmark shapes), then
    SPLIT3 and its DVS 128 variant (the runners-up), then the single per-chunk kernel
    (chunk 64, DV tile 32; 5.2-5.5 ms and 6.6 ms), which stays the tuner's agreement reference.
    DQK 512: L64 x BV32 asks 290 KB of shared memory on the H200 (over the 227 KB limit); L32 x
    BV64 and L16 x BV64 fit (checked against the analytic backward on the H200, not yet timed).
    fp32 from DQK 256: FP32_BACKWARD."""
    if itemsize > 2 and DK >= 256:
        return _fitted(FP32_BACKWARD[min(DK, WIDE_DK)], DK, DV)
    if DK >= WIDE_DK:
        base = dict(L=32, BV=64, BK=64, BVS=128, warps=8, stages=2)
        return _fitted((base, dict(base, L=16, warps=4)), DK, DV)
    base = dict(L=64, BV=32, BK=64, BVS=128, warps=8, stages=2)
    split = [SPLIT2, SPLIT3, dict(SPLIT3, DVS=128)] if itemsize <= 2 else []
    return _fitted(split + [base, dict(base, warps=4), dict(base, BV=64, DVS=64)], DK, DV)


def forward_config(DK: int, DV: int, itemsize: int = 2) -> dict | None:
    """The default forward config, or None where none fits shared memory (the op then runs its
    reference)."""
    if cache.interpreting():
        return _fit(INTERPRETER_CONFIG, DK, DV)
    return next(iter(forward_candidates(DK, DV, itemsize)), None)


def backward_config(DK: int, DV: int, itemsize: int = 2) -> dict | None:
    if cache.interpreting():
        return _fit(INTERPRETER_CONFIG, DK, DV)
    return next(iter(backward_candidates(DK, DV, itemsize)), None)


_CHOSEN: dict = {}
TUNE = True  # False: always the default config (benchmarks/mlstm_sweep.py times configs itself)


def _at_chunk(configs, chunk: int):
    """A keeping forward's config function (forward_config or forward_candidates) with every
    config at the kept states' chunk length, those that fit: the states and row terms it keeps
    are then the ones a backward walking that chunk reads."""
    def at_chunk(DK: int, DV: int, itemsize: int = 2):
        got = configs(DK, DV, itemsize)
        cfgs = got if isinstance(got, list) else [got] if got else []
        fit = _unique([c for c in (dict(c, L=chunk) for c in cfgs)
                       if forward_shared_bytes(c, DK, DV, itemsize) <= SHARED_LIMIT])
        return fit if isinstance(got, list) else next(iter(fit), None)
    return at_chunk


def _tuned(phase: str, q: torch.Tensor, v: torch.Tensor, launch, kept: bool = False, chunk: int | None = None) -> dict:
    """The fastest candidate for this phase and shape class, timed once (launch(cfg) runs the
    phase) and persisted under XACCEL_CACHE_DIR like the GEMM tuning; without CUDA, the default.
    kept: a forward that keeps its chunk states (its configs at the states' chunk length `chunk`)
    or a backward that reads them (no scan): their own decisions, since that changes what is timed."""
    B, H, S, DK = q.shape
    DV = v.shape[-1]
    size = q.element_size()
    config, candidates = (forward_config, forward_candidates) if phase == "fwd" else (backward_config, backward_candidates)
    if chunk is not None:
        config, candidates = _at_chunk(config, chunk), _at_chunk(candidates, chunk)
    if cache.interpreting() or q.device.type != "cuda" or not TUNE:
        return config(DK, DV, size)
    import triton

    key = (f"mlstm_{phase}{'|kept' if kept else ''}{chunk or ''}|{q.dtype}|DK{DK}|DV{DV}|S~{1 << (S - 1).bit_length()}|BH~{1 << (B * H - 1).bit_length()}|"
           f"{torch.cuda.get_device_name(q.device)}|torch{torch.__version__}|triton{triton.__version__}|"
           f"tpl{template_digest()}|tv{cache.TUNING_VERSION}")
    if key in _CHOSEN:
        return _CHOSEN[key]
    default, cands = config(DK, DV, size), candidates(DK, DV, size)  # only on a memo miss
    valid = lambda e: isinstance(e, dict) and e.get("config") in cands  # noqa: E731 - unknown config: retune
    capturing = torch.cuda.is_current_stream_capturing()
    if (capturing or not tuning_enabled()) and not valid(cache.read_entry("tuning", key)):
        if not capturing:
            _CHOSEN[key] = default  # XACCEL_TUNE=0: decided for this process
        return default  # no timing inside a CUDA-graph capture (tune on a later call) or with XACCEL_TUNE=0
    label = f"mlstm {phase} S{S} DQK{DK} DV{DV}"
    def tune():
        timings = []
        return {"config": _fastest(label, default, cands, launch, timings), "timings": timings}
    entry = cache.tuning_decision(key, valid, tune)
    _CHOSEN[key] = entry["config"]
    return _CHOSEN[key]


def _fastest(label: str, default: dict, cands: list[dict], launch, timings: list) -> dict:
    """The fastest candidate; a config must first reproduce the outputs of the reference config
    (each of _compared's, within 1e-2 or 2e-2) before its speed counts. The reference is the
    first config of an original kernel (whole-tile forward, single per-chunk backward:
    _newer_kernel) that runs: the sliced kernel (SLICED) had a version that Triton miscompiled
    on Hopper while the interpreter agreed, so newer variants are checked, not trusted; without
    an original config, the first that runs. No candidate runs: raise (the runtime falls back to
    the reference and says why)."""
    import triton.testing

    cache.precompile(cands, lambda cfg: _warmup(launch, cfg))
    want, ref, error = None, None, None
    for cfg in sorted(cands, key=_newer_kernel):  # stable: in list order among equals
        try:
            want, ref = _compared(launch(cfg)), cfg
            break
        except Exception as e:  # noqa: BLE001 - try the next config
            error = e
    if want is None:
        raise RuntimeError(f"no candidate config of {label} runs here; last error: {type(error).__name__}: {error}")

    def bench(cfg):
        got = _compared(launch(cfg))
        tolerances = [1e-2] + [2e-2] * (len(want) - 1)
        if not all((g - w).norm() <= tol * w.norm() for g, w, tol in zip(got, want, tolerances)):
            raise ValueError("result differs from the reference config's")
        return triton.testing.do_bench(lambda: launch(cfg), warmup=3, rep=15, return_mode="median")
    return cache.fastest(label, cands, bench, best=ref, timings=timings)


def _compared(outputs) -> list:
    """What the agreement check compares: every output of the forward (h and the final state)
    or every input gradient of the backward (dq, dk, dv, di, df: each comes from a different
    kernel of the split backward), finite parts only (degenerate inputs). h and dq within 1e-2
    as before; the others within 2e-2, since two right bf16 configs each carry up to ~3e-3 of
    their own error there (GPU tests) and a broken kernel is off by far more. Not the
    initial-state gradients: dm0 cancels to 1e-2-1e-4 of its terms, so two right configs may
    differ there by more than that in bf16."""
    return [torch.nan_to_num(t.float()) for t in list(outputs)[:5] if t is not None]


def _newer_kernel(cfg: dict) -> bool:
    """Configs that run a later kernel variant (sliced forward, split backward): never the
    tuner's reference while an original config runs."""
    return any(cfg.get(key) for key in ("BKQ", "DVS", "DKS"))


def _supported(q, k, v, S, phase: str) -> bool:
    """Dtypes and head dims the templates cover, and a config of this phase that fits shared
    memory (else the op runs its reference)."""
    DK, DV = q.shape[-1], v.shape[-1]
    if not (q.dtype in DTYPES and DK in HEAD_DIMS and DV in HEAD_DIMS and S > 0
            and all(t.dtype == q.dtype for t in (k, v)) and max(q.numel(), v.numel()) < INT32_LIMIT):
        return False  # (int32 offsets: larger tensors run the reference)
    return cache.interpreting() or _any_config_fits(phase, DK, DV, q.element_size())


@functools.lru_cache(maxsize=None)
def _any_config_fits(phase: str, DK: int, DV: int, itemsize: int) -> bool:
    """Decided once per head shape and dtype size (every call of the op asks)."""
    return bool((forward_candidates if phase == "fwd" else backward_candidates)(DK, DV, itemsize))


CHUNK_SCAN_FACTORS = True
# the chunk-state scan reads each chunk's gate terms (log u per row, g and max log u per chunk)
# from mlstm_chunk_gates, run in parallel over chunks first, instead of a logsigmoid, cumsum and
# max in every tile at every sequential step (False: the old scan, for mlstm_sweep.py --scan-ab)

SCAN_ROW_FACTORS = True
# the reverse state-gradient scan reads r/N and r dden per row and g per chunk,
# written by mlstm_bwd_rows, instead of recomputing the gates' logsigmoid, cumsum and the [L, L]
# stabilizer max on its sequential path in every tile (False: the old scan, for the A/B in
# benchmarks/mlstm_sweep.py --scan-ab)

SAVED_ROWS = True
# the backward from kept chunk states reads each row's den and m_t, stored by the forward, in
# mlstm_bwd_rows instead of recomputing q k^T there (False: recompute, for mlstm_sweep.py --scan-ab)

# The gates' gradients from row sums (all backward configs since the sixteenth session; the flags
# GATES_FROM_ROW_SUMS and UNSPLIT_GATES_FROM_ROW_SUMS are retired with the per-chunk gate
# algebra they replaced): with the stabilizers fixed, di = k.dk per row and dlogf inside each chunk
# is a reverse cumsum of q.dq - k.dk, plus <C, dC> at the chunk's end for the rows after it, taken
# by the state scan (exact, see mlstm_bwd_ds.py.jinja). The per-chunk kernels sum q.dq and k.dk
# from their fp32 dq and dk (mlstm_bwd_dqdk per DK tile, or the unsplit mlstm_bwd), and
# mlstm_bwd_route adds them up. H200, backward from kept states, bf16 (mlstm_sweep.py --scan-ab):
# split configs 2.553 -> 2.290 ms at B8 NH16 S8192 128/128, 3.430 -> 3.074 at B8 NH8 S4096
# 256/512, 0.912 -> 0.816 (kernels) at the model's shape; the first unsplit candidate 4.542 ->
# 3.219 at 128/128, 1.207 -> 1.070 at B4 NH8 S2048 256/512, and at 512/512 its per-chunk kernel
# 3.228 -> 0.324 ms (the algebra's live tiles no longer spill). More accurate too: the algebra's
# reverse cumsum cancelled differently rounded terms, and with fast decay (every input ~ N(0, .58),
# as xLSTMLarge at init) its bf16 df error from fp64 was 2.6e-2 at 256/512 and 1.8e-2 at 512/512
# against the row sums' 3.3e-3 and 5.4e-3 (pytest -m gpu -k row_sums). A cumsum over the whole row
# (no <C, dC>) lost df accuracy along the row (2.3e-2), and <C, dC> taken in mlstm_bwd_ds cost that
# kernel more than the scan (docs/benchmarks.md, fifteenth and sixteenth sessions).

FUSED_ROUTE = True
# the backward's last step, the eps term routed through the stabilizer max and the gates' final
# gradients, in one Triton kernel per row (mlstm_bwd_route) instead of ~12 small torch launches
# and a cummax (H200, backward from kept states, benchmarks/mlstm_sweep.py --route-ab: 2.759 ->
# 2.560 ms at B8 NH16 S8192 128/128, 3.562 -> 3.432 at B8 NH8 S4096 256/512, 1.025 -> 0.928 at the
# model's B4 NH8 S2048; gradients equal to 1.5e-5). False: the torch tail, for that A/B.

READ_STRIDED = True  # False: copy every non-contiguous input first (benchmarks/mlstm_layout_probe.py times both)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t itself when the kernels can read it in place (unit stride along the head dim; the gates
    [B, H, S] take any strides), else a contiguous copy: the usual transposed projections
    ([B, S, H, D] viewed as [B, H, S, D]) then cost no copy in the forward or the backward.
    Also a copy when its farthest element lies 2^31 or more elements from its start (e.g. q
    sliced from a wide fused projection): the kernels compute offsets in int32."""
    if not READ_STRIDED or (t.dim() == 4 and t.stride(-1) != 1) or t.numel() == 0:
        return t.contiguous()
    return t if reach(t) <= INT32_LIMIT else t.contiguous()


def _rows(*ts: torch.Tensor) -> list[int]:
    """The kernels' row_args: the head count, then each tensor's batch, head and position strides."""
    return [ts[0].shape[1]] + [st for t in ts for st in t.stride()[:3]]


def chunk_states(k, v, i, f, C0, n0, m0, cfg):
    """Run the sequential scan: (Cs, ns, ms) the state entering each chunk ([B*H*NC*DK*DV] in the
    input dtype, [.. DK] and [..] fp32) and the final state (C, n, m) in fp32: mlstm_chunk_gates
    prepares every chunk's gate terms in parallel, then mlstm_chunk_states walks the chunks with
    one matmul per step."""
    B, H, S, DK = k.shape
    DV = v.shape[-1]
    L, BK, BVS, stages = cfg["L"], cfg["BK"], cfg["BVS"], cfg["stages"]
    NC = -(-S // L)
    dev, f32 = k.device, torch.float32
    if B * H * NC * DK * DV >= INT32_LIMIT:  # the kernels' offsets are int32: this config cannot run here
        raise ValueError(f"mLSTM chunk states at chunk {L} would hold {B * H * NC * DK * DV} elements (>= 2^31)")
    Cs = torch.empty(B * H * NC * DK * DV, dtype=k.dtype, device=dev)
    ns = torch.empty(B * H * NC * DK, dtype=f32, device=dev)
    ms = torch.empty(B * H * NC, dtype=f32, device=dev)
    C = torch.empty(B, H, DK, DV, dtype=f32, device=dev)
    n = torch.empty(B, H, DK, dtype=f32, device=dev)
    m = torch.empty(B, H, dtype=f32, device=dev)
    has_state = C0 is not None
    if has_state:
        C0, n0, m0 = (t.float().contiguous() for t in (C0, n0, m0))
    else:
        C0, n0, m0 = C, n, m  # unused by the kernel
    gates = []
    if CHUNK_SCAN_FACTORS:  # each chunk's gate terms, in parallel, off the sequential scan
        gates = [torch.empty(B * H * NC * L, dtype=f32, device=dev), torch.empty(B * H * NC * 2, dtype=f32, device=dev)]
        _launch(_kernel("mlstm_chunk_gates.py.jinja", k.dtype), (B * H, NC), i, f, *gates, *_rows(i, f), S, NC, L=L)
    _launch(_kernel("mlstm_chunk_states.py.jinja", k.dtype, has_state=has_state, gate_factors=CHUNK_SCAN_FACTORS,
                    loads_first=bool(cfg.get("LF"))),
        (B * H, DK // BK, DV // BVS), k, v, i, f, C0, n0, m0, Cs, ns, ms, C, n, m, *gates, *_rows(k, v, i, f), S, NC,
        DK ** -0.5, DK=DK, DV=DV, BK=BK, BV=BVS, L=L, num_warps=_scan_warps(cfg), num_stages=stages)
    return (Cs, ns, ms), (C, n, m)


def forward(key, q, k, v, i, f, C0, n0, m0, eps, chunk_size, keep_chunk_states=False):
    """Kernel path for xaccel::mlstm's forward, or NotImplemented for cases it does not cover: the
    chunk-state scan, then every chunk's output in parallel. chunk_size only shapes the
    reference's evaluation; the kernels pick their own chunk length (results agree to rounding).
    keep_chunk_states (xaccel::mlstm_with_chunk_states): also return the state entering each chunk
    of chunk_size positions and each row's den_t and m_t, the forward then running at that chunk
    length (its own tuning decision), so that a backward walking the same chunks reads them."""
    S = q.shape[2]
    if not _supported(q, k, v, S, "fwd") or \
            keep_chunk_states and not keeping_forward_fits(q.shape[-1], v.shape[-1], q.element_size(), chunk_size):
        return NotImplemented
    q, k, v, i, f = (_strided(t) for t in (q, k, v, i, f))
    if not keep_chunk_states:
        cfg = _tuned("fwd", q, v, lambda c: _forward(c, q, k, v, i, f, C0, n0, m0, eps))
        return _forward(cfg, q, k, v, i, f, C0, n0, m0, eps)
    run = lambda c: _forward_keeping(c, q, k, v, i, f, C0, n0, m0, eps, chunk_size)  # noqa: E731
    return run(_tuned("fwd", q, v, run, kept=True, chunk=chunk_size))


def keeping_forward_fits(DK: int, DV: int, itemsize: int, chunk_size: int) -> bool:
    """Whether a forward at chunk_size fits (shared memory) for these head dims and dtype."""
    return chunk_size in CHUNKS and _at_chunk(forward_config, chunk_size)(DK, DV, itemsize) is not None


def _forward_keeping(cfg, q, k, v, i, f, C0, n0, m0, eps, chunk_size):
    from torch_xaccel.ops.mlstm import chunk_states_shapes

    assert cfg["L"] == chunk_size, (cfg, chunk_size)
    h, C, n, m, states, rows = _forward(cfg, q, k, v, i, f, C0, n0, m0, eps, keep=True)
    kept = [t.view(shape) for t, (shape, _) in zip((*states, rows), chunk_states_shapes(q, v, chunk_size))]
    return (h, C, n, m, *kept)


CHUNKS = (16, 32, 64, 128)  # chunk lengths the kernels take (the kept states' chunk_size among them)


def backward_reads_kept_states(device_type: str, dtype: torch.dtype, DK: int, DV: int, chunk_size: int) -> bool:
    """Whether keeping the chunk states in a training graph pays: the kernels run there (CUDA, or
    Triton's interpreter) and every backward config they may pick walks chunks of chunk_size, so
    the kept states replace the backward's scan. Else (the CPU reference, whose backward ignores
    them; DQK 512 or fp32 from DQK 256, whose backward chunks are 16-32; a chunk size the kernels
    do not take) they would be held for nothing (lowering.keep_mlstm_chunk_states asks)."""
    if chunk_size not in CHUNKS or dtype not in DTYPES or DK not in HEAD_DIMS or DV not in HEAD_DIMS:
        return False
    if not keeping_forward_fits(DK, DV, dtype.itemsize, chunk_size):
        return False  # the op would run its reference
    if cache.interpreting():
        return device_type == "cpu" and backward_config(DK, DV, dtype.itemsize)["L"] == chunk_size
    cands = backward_candidates(DK, DV, dtype.itemsize)
    return device_type == "cuda" and bool(cands) and all(c["L"] == chunk_size for c in cands)


def _forward(cfg, q, k, v, i, f, C0, n0, m0, eps, keep=False):
    """keep: also return the chunk states and each row's (den_t, m_t) [B*H, 2, S] fp32."""
    B, H, S, DK = q.shape
    DV = v.shape[-1]
    L = cfg["L"]
    (Cs, ns, ms), (C, n, m) = chunk_states(k, v, i, f, C0, n0, m0, cfg)
    h = torch.empty(B, H, S, DV, dtype=q.dtype, device=q.device)
    rows = torch.empty(B * H * 2 * S, dtype=torch.float32, device=q.device) if keep else None
    NC = -(-S // L)
    args = (q, k, v, i, f, h, Cs, ns, ms, *((rows,) if keep else ()), *_rows(q, k, v, i, f), S, NC, DK ** -0.5, eps)
    meta = dict(DK=DK, DV=DV, BV=cfg["BV"], L=L, num_warps=cfg["warps"], num_stages=cfg["stages"])
    if cfg.get("BKQ"):  # the sliced output kernel (SLICED)
        meta["BKQ"] = cfg["BKQ"]
    _launch(_kernel("mlstm_fwd.py.jinja", q.dtype, k_loop=bool(cfg.get("BKQ")), save_rows=keep),
            (B * H, NC, DV // cfg["BV"]), *args, **meta)
    if keep:
        return h, C, n, m, (Cs, ns, ms), rows
    return h, C, n, m


def step(key, q, k, v, i, f, C, n, m, eps, scale_q=False):
    """Kernel path for xaccel::mlstm_step, or NotImplemented. Capturable in a CUDA graph (no host
    synchronisation, outputs allocated by the caching allocator)."""
    B, H, DK = q.shape
    DV = v.shape[-1]
    if q.dtype not in DTYPES or DK not in HEAD_DIMS or DV not in HEAD_DIMS or not all(t.dtype == q.dtype for t in (k, v)) \
            or B * H * DK * DV >= INT32_LIMIT:  # int32 offsets into the state
        return NotImplemented
    q, k, v, i, f = (t.contiguous() for t in (q, k, v, i, f))
    C, n, m = (t.float().contiguous() for t in (C, n, m))
    h = torch.empty(B, H, DV, dtype=q.dtype, device=q.device)
    C2, n2, m2 = torch.empty_like(C), torch.empty_like(n), torch.empty_like(m)
    BV = min(DV, 64)
    key = ("step", cache.interpreting())
    if key not in _KERNELS:
        name = "mlstm_step_" + hashlib.sha256(b"mlstm_step|v2").hexdigest()[:12]
        src = _ENV.get_template("mlstm_step.py.jinja").render(kernel_name=name)
        _KERNELS[key] = getattr(cache.load_source(name, src), name)
    q_scale, k_scale = (DK ** -0.5, 1.0) if scale_q else (1.0, DK ** -0.5)
    # eps as a float: the compiled kernel's argument type must not depend on how a caller spelled it
    args, meta, grid = (q, k, v, i, f, C, n, m, h, C2, n2, m2, q_scale, k_scale, float(eps)), dict(DK=DK, DV=DV, BV=BV), (B * H, DV // BV)
    # a decode step is host-bound: from the second call of a shape, its compiled kernel directly
    shape = (key, q.dtype, q.device, B, H, DK, DV)
    direct = _STEP_LAUNCHES.get(shape)
    if direct and direct.matches(args[:12]):
        direct(args)
    else:
        compiled = _KERNELS[key][grid](*args, **meta)
        if direct is None:
            if len(_STEP_LAUNCHES) >= 1024:
                _STEP_LAUNCHES.clear()
            _STEP_LAUNCHES[shape] = DirectLaunch.capture(_KERNELS[key], compiled, grid, meta, len(args), args[:12]) or False
    return h, C2, n2, m2


_STEP_LAUNCHES: dict = {}  # (kernel key, dtype, device, B, H, DK, DV) -> DirectLaunch, or False where none


def backward(key, dh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size, h=None, chunk_states=()):
    """Kernel path for xaccel::mlstm's backward (same contract as ops/mlstm_backward.backward), or
    NotImplemented. Four launches: the chunk-state scan again (skipped when the forward kept its
    states, chunk_states = [Cs, ns, ms, rows, C, n, m] at chunk_size, and the config's chunk is
    chunk_size), per-row normalizer terms (from the saved output h and, with kept states, the
    forward's den_t and m_t; else q k^T again; h recomputed when absent), the
    reverse state-gradient scan, then every chunk's dq, dk, dv and gate gradients in parallel.
    The eps term is routed through the stabilizer max here in torch (a cummax over [B, H, S]), or
    with FUSED_ROUTE in one kernel (route_max_grad)."""
    B, H, S, DK = q.shape
    DV = v.shape[-1]
    if not _supported(q, k, v, S, "bwd") or dh is None and gC is None:
        return NotImplemented
    dev, f32 = q.device, torch.float32
    q, k, v, i, f = (_strided(t) for t in (q, k, v, i, f))
    if h is None:
        h = forward(key, q, k, v, i, f, C0, n0, m0, eps, chunk_size)[0]
    h = h.contiguous()
    dh = torch.zeros_like(h) if dh is None else _strided(dh)
    gC = torch.zeros(B, H, DK, DV, device=dev, dtype=f32) if gC is None else gC.float().contiguous()
    gn = torch.zeros(B, H, DK, device=dev, dtype=f32) if gn is None else gn.float().contiguous()
    gm = torch.zeros(B, H, device=dev, dtype=f32) if gm is None else gm.float()
    kept = _kept_states(chunk_states, q, v, chunk_size)
    cfg = _tuned("bwd", q, v, lambda c: _backward(c, dh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, h, kept),
                 kept=kept is not None)
    return _backward(cfg, dh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, h, kept)


def _kept_states(chunk_states, q, v, chunk_size):
    """(chunk_size, (Cs, ns, ms) flat as chunk_states() returns them, rows flat, (C, n, m)) from
    the forward's kept states, or None when there are none or they do not have the layout the
    kernels read (then the backward reruns the scan and recomputes the row terms)."""
    if not chunk_states:
        return None
    from torch_xaccel.ops.mlstm import chunk_states_shapes

    Cs, ns, ms, rows, C, n, m = chunk_states
    want = chunk_states_shapes(q, v, chunk_size)
    if any(tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous()
           for t, (shape, dtype) in zip((Cs, ns, ms, rows), want)):
        return None
    return (chunk_size, (Cs.view(-1), ns.view(-1), ms.view(-1)), rows.view(-1),
            tuple(t.float().contiguous() for t in (C, n, m)))


def route_max_grad(dm, gm, dmT, i, f, rs, cdc, L, m0=None):
    """(di, df in the gates' dtypes, the routed part of dm0 or None) in one launch
    (mlstm_bwd_route): the gates' gradients with the stabilizers fixed from q.dq and k.dk per row
    and DK tile (rs, [B*H, tiles, 2, S]) and <C, dC> at each chunk's end (cdc, [B*H, NC]; chunk
    length L), plus the eps term dm [B, H, S] (gm + dmT.sum(-1) added to its last row) routed
    through the stabilizer max: what _backward's torch tail computes with
    ops/mlstm_backward._route_max_grad."""
    from triton import next_power_of_2

    B, H, S = i.shape
    i, f = _strided(i), _strided(f)
    start = torch.empty(B * H * S, dtype=torch.int8, device=i.device)
    di_out = torch.empty((B, H, S), dtype=i.dtype, device=i.device)
    df_out = torch.empty((B, H, S), dtype=f.dtype, device=i.device)
    dm0 = torch.empty((B, H), dtype=torch.float32, device=i.device) if m0 is not None else None
    NT = dmT.shape[-1]
    block = min(1024, next_power_of_2(S))
    _launch(_kernel("mlstm_bwd_route.py.jinja", i.dtype, has_state=m0 is not None), (B * H,),
            i, f, dm, gm.float().contiguous(), dmT, rs, rs.numel() // (B * H * 2 * S), cdc, cdc.numel() // (B * H),
            m0.float().contiguous() if m0 is not None else dm,
            start, di_out, df_out, dm0 if dm0 is not None else dm, *_rows(i, f), S, NT,
            NTP=next_power_of_2(NT), BLOCK=block, L=L, num_warps=4)
    return di_out, df_out, dm0


def gates_from_row_sums(rs, cdc, dmT, B: int, H: int, S: int, L: int):
    """(di, dlogf) [B, H, S] with the stabilizers fixed, in torch: di_t = k_t.dk_t and dlogf_p the
    sum of q_t.dq_t - k_t.dk_t over the rows t >= p of p's chunk plus <C, dC> at the chunk's end
    (cdc, [B*H, NC]; for the last chunk the final state's <gC, C_T> + <gn, n_T>, -dmT summed), from
    the row sums rs [B*H, tiles, 2, S] (mlstm_bwd_ds says why). What mlstm_bwd_route computes before
    routing the eps term; the torch tail (FUSED_ROUTE False) and the tests use it."""
    import torch.nn.functional as F

    NC = -(-S // L)
    r = rs.view(B, H, -1, 2, S).sum(2)
    d = F.pad(r[:, :, 0] - r[:, :, 1], (0, NC * L - S)).view(B, H, NC, L)
    ends = cdc.view(B, H, NC).clone()
    ends[..., -1] = -dmT.sum(-1).view(B, H)
    return r[:, :, 1], (d.flip(-1).cumsum(-1).flip(-1) + ends[..., None]).view(B, H, NC * L)[..., :S]


def _backward(cfg, dh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, h, kept=None):
    import torch.nn.functional as F

    from torch_xaccel.ops.mlstm import gradient_like
    from torch_xaccel.ops.mlstm_backward import _route_max_grad

    B, H, S, DK = q.shape
    DV = v.shape[-1]
    dev, f32 = q.device, torch.float32
    L, BK, BVS, warps, stages = cfg["L"], cfg["BK"], cfg["BVS"], cfg["warps"], cfg["stages"]
    NC, NT = -(-S // L), (DK // BK) * (DV // BVS)
    rows = None
    if kept is not None and kept[0] == L:  # the forward's states and row terms: no second scan, no q k^T
        (Cs, ns, ms), rows, (CT, nT, mT) = kept[1:]
        rows = rows if SAVED_ROWS else None
    else:
        (Cs, ns, ms), (CT, nT, mT) = chunk_states(k, v, i, f, C0, n0, m0, cfg)
    N, dden, dm = (torch.empty(B, H, S, device=dev, dtype=f32) for _ in range(3))
    # the scan's row factors r/N, r dden [B, H, S] and each chunk's log forget product g [B*H*NC]
    factors = [torch.empty(n, device=dev, dtype=f32) for n in (B * H * S, B * H * S, B * H * NC)] \
        if SCAN_ROW_FACTORS else []
    saved = (rows,) if rows is not None else ()
    _launch(_kernel("mlstm_bwd_rows.py.jinja", q.dtype, row_factors=SCAN_ROW_FACTORS, saved_rows=bool(saved)),
        (B * H, NC), q, k, i, f, h, dh, ns, ms, *saved, N, dden, dm, *factors, *_rows(q, k, i, f, dh),
        S, NC, DK ** -0.5, eps, DK=DK, DV=DV, BV=cfg["BV"], L=L, num_warps=warps, num_stages=stages)
    dCs, dns = torch.empty_like(Cs), torch.empty_like(ns)
    dC0, dn0 = torch.empty_like(gC), torch.empty_like(gn)
    DVS = cfg.get("DVS")  # split variant: dv in its own kernel, one program per DV tile
    DKS = cfg.get("DKS")  # and dq, dk in theirs, one program per DK tile (without DVS: dv stays in mlstm_bwd_ds)
    dmT = torch.empty(B * H, NT, device=dev, dtype=f32)
    dg = torch.empty(B * H, NC, NT, device=dev, dtype=f32)  # per (chunk, scan tile) parts of <C, dC> at the chunk's end
    _launch(_kernel("mlstm_bwd_states.py.jinja", q.dtype, row_factors=SCAN_ROW_FACTORS),
        (B * H, DK // BK, DV // BVS), q, dh, i, f, N, dden, Cs, ns, ms, gC, gn, CT, nT, mT, dCs, dns, dg, dmT, dC0, dn0,
        *factors, *_rows(q, dh, i, f), S, NC, NT, DK=DK, DV=DV, BK=BK, BV=BVS, L=L, num_warps=_scan_warps(cfg), num_stages=stages)
    # the stabilizer of the state leaving each chunk, which scales its gradient in dCs, dns
    me = torch.cat((ms.view(B * H, NC)[:, 1:], mT.reshape(B * H, 1).float()), 1).contiguous()
    # in the layout the op's fake promises (ops/mlstm.gradient_strides: a dense transposed view's own)
    dq, dk, dv = (gradient_like(t) for t in (q, k, v))
    dg = dg.sum(-1)  # <C, dC> at each chunk's end
    # the gates' gradients from q.dq and k.dk per row and DK tile (the row-sum note above FUSED_ROUTE)
    rs = torch.empty(B * H * (DK // DKS if DKS else 1) * 2 * S, device=dev, dtype=f32)
    if DVS:
        _launch(_kernel("mlstm_bwd_dv.py.jinja", q.dtype), (B * H, NC, DV // DVS),
            q, k, v, i, f, dh, ms, me, dCs, N, dv,
            *_rows(q, k, v, i, f, dh, dv), S, NC, DK ** -0.5, DK=DK, DV=DV, BV=DVS, L=L, num_warps=warps, num_stages=stages)
    if DKS:  # dS scratch: L/DK of q's size (128 MiB at B8 NH16 S8192 128/128)
        dS = torch.empty(B * H * NC * L * L, device=dev, dtype=q.dtype)
        wu = torch.empty(B * H * NC * 2 * L, device=dev, dtype=f32)
        _launch(_kernel("mlstm_bwd_ds.py.jinja", q.dtype, split_dv=bool(DVS)), (B * H, NC),
            q, k, v, i, f, dh, ms, me, dCs, N, dden, dS, wu, dv, *_rows(q, k, v, i, f, dh, *(() if DVS else (dv,))),
            S, NC, DK ** -0.5, DK=DK, DV=DV, BV=cfg["BV"], L=L, num_warps=warps, num_stages=stages)
        _launch(_kernel("mlstm_bwd_dqdk.py.jinja", q.dtype), (B * H, NC, DK // DKS),
            q, k, v, dh, Cs, ns, dCs, dns, N, dden, dS, wu, dq, dk, rs,
            *_rows(q, k, v, dh, dq, dk), S, NC, DK ** -0.5,
            DK=DK, DV=DV, BK=DKS, BV=cfg["BV"], L=L, num_warps=warps, num_stages=stages)
    else:
        _launch(_kernel("mlstm_bwd.py.jinja", q.dtype, split_dv=bool(DVS)), (B * H, NC),
            q, k, v, i, f, dh, Cs, ns, ms, me, dCs, dns, N, dden, dq, dk, dv, rs,
            *_rows(q, k, v, i, f, dh, dq, dk, *(() if DVS else (dv,))), S, NC, DK ** -0.5,
            DK=DK, DV=DV, BV=cfg["BV"], L=L, num_warps=warps, num_stages=stages)
    m0s = m0.float() if C0 is not None else None
    if FUSED_ROUTE:
        di_out, df_out, r_dm0 = route_max_grad(dm, gm, dmT, i, f, rs, dg, L, m0s)
    else:
        di, dlogf = gates_from_row_sums(rs, dg, dmT, B, H, S, L)
        dm[..., -1] += gm + dmT.sum(-1).view(B, H)
        i32, f32_ = i.float(), f.float()
        r_di, r_dlogf, r_dm0 = _route_max_grad(dm, i32, F.logsigmoid(f32_).cumsum(-1), m0s)
        di_out, df_out = (di + r_di).to(i.dtype), ((dlogf + r_dlogf) * torch.sigmoid(-f32_)).to(f.dtype)
    grads = [dq, dk, dv, di_out, df_out]
    if C0 is not None:  # dC0, dn0: stabilized by m0, as C0 and n0 are
        grads += [dC0.to(C0.dtype), dn0.to(n0.dtype),
                  ((dC0 * C0.float()).sum((-1, -2)) + (dn0 * n0.float()).sum(-1) + r_dm0).to(m0.dtype)]
    else:
        grads += [None, None, None]
    return grads
