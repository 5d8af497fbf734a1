"""Generated Triton kernels for xaccel::gemm_epilogue: render, build, tune, launch.

For each op signature, dtype and shape class the fastest of the tile configurations below and the
ATen composition (cuBLAS + eager chain) is picked by timing once; the choice is stored on disk
keyed by GPU, torch, Triton and template versions. Returns NotImplemented for cases the kernel
does not cover (batched B, empty tensors, other devices), so the runtime runs the reference.
"""
from __future__ import annotations

import functools
import time

import torch

from torch_xaccel import config, runtime
from torch_xaccel.ops.gemm_epilogue import reference
from torch_xaccel.ops.gemm_epilogue.epilogue_ir import parse
from torch_xaccel.runtime import interpreting

from .. import cache, tuning
from ..limits import INT32_LIMIT, SHARED_LIMIT, reach
from ..triton_launch import DirectLaunch, remember
from . import cutlass_kernels as cutlass
from .render import TEMPLATES, render_triton

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (variant, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, flatten)
#   ptr: one tile per program, pointer loads;  tma: persistent, tensor-descriptor loads (Hopper);
#   tma2: tma with the epilogue run on two half tiles (fewer live registers next to the accumulator)
#   Not here on purpose: tl.range(warp_specialize=True), which hangs on sm_90 with Triton 3.6.
LARGE = [("tma", 128, 256, 64, 8, 8, 3, 1), ("tma", 128, 256, 64, 8, 8, 3, 0), ("tma", 256, 128, 64, 8, 8, 3, 1),
         ("tma", 128, 128, 64, 8, 8, 4, 1), ("tma", 128, 128, 64, 8, 4, 4, 1),
         ("tma2", 128, 256, 64, 8, 8, 3, 1), ("tma2", 128, 256, 64, 8, 8, 3, 0), ("tma2", 256, 128, 64, 8, 8, 3, 1),
         ("ptr", 128, 256, 64, 8, 8, 3, 0), ("ptr", 128, 128, 64, 8, 4, 4, 0)]
SMALL_M = [("ptr", 128, 64, 128, 8, 4, 4, 0), ("ptr", 128, 32, 128, 8, 4, 5, 0), ("ptr", 128, 64, 64, 8, 4, 6, 0),
           ("ptr", 64, 64, 128, 8, 4, 4, 0), ("ptr", 64, 128, 64, 8, 4, 4, 0), ("ptr", 32, 64, 128, 8, 4, 4, 0),
           ("ptr", 64, 32, 256, 8, 4, 3, 0), ("tma", 128, 64, 128, 8, 4, 4, 0), ("tma", 128, 32, 128, 8, 4, 5, 0),
           ("tma", 64, 64, 128, 8, 4, 5, 0), ("ptr", 128, 128, 64, 8, 8, 4, 0), ("tma", 128, 128, 64, 8, 8, 4, 0)]
# the 128x128 ptr/tma pair (listed last): at M128 one 128-row tile reads each weight tile once, with
# N/128 programs (about one per SM at N16384), where ptr 64x128x64 reads W twice and relies on L2
# for the second read; tuning picks between them per shape class (measured: docs/benchmarks.md's git history).
# No split-K configs (fp32 partial sums over slices of K, then a reduce + epilogue kernel): they
# lost to the unsplit ones on decode shapes, even on a down projection with few output tiles
# (measured: docs/benchmarks.md's git history).
DUAL = [("tma", 128, 128, 64, 8, 8, 3, 1), ("tma", 128, 128, 64, 8, 8, 4, 0), ("tma", 128, 128, 64, 8, 8, 3, 0),
        ("tma", 256, 128, 64, 8, 8, 2, 1), ("tma2", 128, 128, 64, 8, 8, 4, 0), ("tma2", 128, 128, 64, 8, 8, 3, 1),
        ("ptr", 128, 128, 64, 8, 8, 3, 0), ("ptr", 128, 64, 64, 8, 4, 4, 0)]
# N <= 64 (e.g. an xLSTM block's gate projections, N = 8): reading `a` is the whole cost, so narrow
# tiles and enough programs; three configs, not LARGE's ten: each candidate is a Triton compile,
# which adds to a cold compile's time
NARROW_N = [("ptr", 64, 16, 256, 8, 4, 3, 0), ("ptr", 32, 32, 256, 8, 4, 3, 0), ("ptr", 128, 32, 128, 8, 4, 4, 0)]
NARROW_N_COLS = 64
# M <= DECODE_M_ROWS (a decode step's batch): 16-row tiles, the fewest tl.dot takes, and the whole
# grid along N. SMALL_M's 32-128-row tiles compute and stage 32-128 rows for one (GPU times against
# SMALL_M and cuBLAS: benchmarks/decode_gemm_host.py, docs/benchmarks.md).
DECODE = [("ptr", 16, 64, 256, 1, 4, 3, 0), ("ptr", 16, 64, 128, 1, 4, 4, 0), ("ptr", 16, 128, 128, 1, 4, 4, 0),
          ("ptr", 16, 32, 256, 1, 4, 3, 0)]
DECODE_NARROW_N = [NARROW_N[0], ("ptr", 16, 16, 512, 1, 4, 3, 0), ("ptr", 16, 32, 128, 1, 2, 4, 0)]
DECODE_M_ROWS = 16
FP32 = [("ptr", 128, 128, 32, 8, 8, 3, 0), ("ptr", 64, 128, 32, 8, 4, 4, 0), ("ptr", 64, 64, 32, 8, 4, 4, 0)]
INTERPRETER = ("ptr", 32, 32, 32, 4, 4, 1, 0)


def shared_bytes(cfg: tuple, n_gemms: int, itemsize: int = 2) -> int:
    """Shared memory a config needs: num_stages buffers of the A and B tiles plus one output tile
    for the epilogue's store. Within 64 bytes of what Triton 3.6 asks for the TMA kernels on sm_90
    (262176 for tma 128x256x64 with 4 stages, which does not fit); the ptr kernels ask up to that
    output tile less, so the estimate errs on the safe side."""
    _, bm, bn, bk, _, _, stages, _ = cfg
    return stages * (bm + n_gemms * bn) * bk * itemsize + bm * bn * itemsize


SUSTAINED_MS = 1.0  # ATen slower than this: candidates are timed back to back (_tune)
SMALL_M_ROWS = 256  # at most this many rows: the decode-sized configs, timed as GPU time only (tuning.gpu_ms)


def candidates(m: int, n_gemms: int, dtype: torch.dtype, n: int | None = None) -> list[tuple]:
    """The tile configs tuning times for a shape class (m rows, n output columns when known), less
    those whose tiles for n_gemms weight matrices do not fit shared memory: with tuning off
    (XACCEL_TUNE=0) the first is run untimed, so it must fit (SMALL_M's first config does not for a
    small-M dual GEMM)."""
    if dtype == torch.float32:
        listed = FP32
    elif n is not None and n <= NARROW_N_COLS and n_gemms == 1:
        listed = DECODE_NARROW_N if m <= DECODE_M_ROWS else NARROW_N
    elif m <= DECODE_M_ROWS:
        listed = DECODE
    elif m <= SMALL_M_ROWS:
        listed = SMALL_M
    else:
        listed = DUAL if n_gemms > 1 else LARGE
    return [c for c in listed if shared_bytes(c, n_gemms, dtype.itemsize) <= SHARED_LIMIT]


_KERNELS: dict = {}


def _kernel(epilogue: str, n_operands: int, precision: str, variant: str, b_transposed: bool):
    """(name, Triton kernel) for an epilogue, rendered and imported once per process and mode."""
    key = (epilogue, n_operands, precision, variant, b_transposed, interpreting())
    if key not in _KERNELS:
        name, src = render_triton(parse(epilogue), n_operands, precision, variant, b_transposed,
                                  sizes_constexpr=interpreting())
        _KERNELS[key] = name, getattr(cache.load_source(name, src), name)
    return _KERNELS[key]


def _tma_ok(t: torch.Tensor) -> bool:
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.shape[0] > 0 and t.shape[1] > 0)


class _Case:
    """Everything a launch needs, prepared once per call."""

    def __init__(self, a, bs, operands, epilogue, b_transposed):
        self.ep = parse(epilogue)
        K = a.shape[-1]
        self.M, self.K = a.numel() // K, K
        self.N = bs[0].shape[0] if b_transposed else bs[0].shape[1]
        self.a2 = a.reshape(self.M, K)
        if len({b.stride() for b in bs}) > 1:
            bs = [b.contiguous() for b in bs]
        s0, s1 = bs[0].stride()
        self.b_strides = (s1, s0) if b_transposed else (s0, s1)
        self.bs = bs
        self.out_shape = (*a.shape[:-1], self.N)
        bcast = self.bcast = self.ep.broadcasts()
        self.ops, self.op_strides = [], []
        for j, t in enumerate(operands):
            kind = bcast.get(j)  # None: an operand the epilogue never reads
            if kind is None:
                t2, strides = t, (0, 0)
            elif kind == "full":
                t2 = t.reshape(self.M, self.N)
                strides = t2.stride()
            elif kind == "row":
                t2 = t.reshape(self.N)
                strides = (0, t2.stride(0))
            elif kind == "col":
                t2 = t.reshape(self.M)
                strides = (t2.stride(0), 0)
            else:
                t2 = t.reshape(1)
                strides = (0, 0)
            self.ops.append(t2)
            self.op_strides += list(strides)
        if a.dtype == torch.float32:
            tf32 = torch.backends.cuda.matmul.allow_tf32 and not interpreting()
            self.precision = "tf32" if tf32 else "ieee"
        else:
            self.precision = "ieee"
        self.epilogue, self.b_transposed = epilogue, b_transposed
        self.tma = (self.a2.device.type == "cuda" and not interpreting()
                    and all(_tma_ok(t) for t in (self.a2, *self.bs)))
        self.dtype, self.device = a.dtype, a.device

    def new_outputs(self):
        return [torch.empty((self.M, self.N), dtype=self.dtype, device=self.device) for _ in self.ep.outputs]

    def usable(self, cfg) -> bool:
        if cfg[0] in cutlass.VARIANTS:
            return self.cutlass_reason is None
        return cfg[0] == "ptr" or self.tma

    @functools.cached_property
    def cutlass_reason(self) -> str | None:
        """Why this call cannot run as a CUTLASS kernel (None: it can)."""
        return cutlass.unsupported(self.ep, self.a2, self.bs, self.ops, self.b_transposed, self.bcast)

    def cutlass_source(self, cfg) -> tuple[str, str]:
        key = (self.epilogue, self.dtype, tuple(t.dtype for t in self.ops), tuple(sorted(self.bcast.items())),
               self.b_transposed, cfg[:6])
        if key not in _CUTLASS_SOURCES:
            _CUTLASS_SOURCES[key] = cutlass.render(self.ep, self.dtype, [t.dtype for t in self.ops], self.bcast,
                                                         self.b_transposed, cfg)
        return _CUTLASS_SOURCES[key]

    def launch(self, cfg, outs, warmup: bool = False) -> None:
        """Run config `cfg` into `outs`; warmup: only compile it (Triton's warmup run, no launch)."""
        if cfg[0] in cutlass.VARIANTS:
            lib = cutlass.load(*self.cutlass_source(cfg))
            if not warmup:
                cutlass.launch(lib, cfg, self.a2, self.bs[0], self.ops, outs, _num_sms(self.device))
            return
        _Plan(self, cfg).launch(self.a2, self.bs, self.ops, outs, warmup)

    def label(self) -> str:
        """For reports: 'bfloat16 M16384 N16384 K4096: add(row) -> gelu_tanh -> add(full)'."""
        return f"{str(self.dtype).replace('torch.', '')} M{self.M} N{self.N} K{self.K}: {self.ep.describe()}"

    @property
    def kernel_name(self) -> str:
        return _kernel(self.epilogue, len(self.ops), self.precision, "ptr", self.b_transposed)[0]

    def tuning_key(self) -> str:
        m_class = max(16, 1 << (self.M - 1).bit_length())
        ops = ",".join(f"{tuple(t.shape)}" for t in self.ops)
        parts = f"{self.kernel_name}|{self.dtype}|M~{m_class}|N{self.N}|K{self.K}|b{self.b_strides}|ops{ops}"
        return tuning.key("gemm_epilogue", parts, self.device, TEMPLATES.digest)


_SMS: dict = {}
_CUTLASS_SOURCES: dict = {}


def _num_sms(device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tune(case: _Case, reference_fn, cands, make_case, timings: list, steady=None) -> tuple | None:
    """Time every config and the ATen composition; None means ATen won. Large GEMMs: plain
    do_bench, the per-call preparation (make_case) inside the kernel timing. Small-M cases
    (decode, M <= SMALL_M_ROWS): GPU time only (tuning.gpu_ms), both sides alike: plain timing there
    measures the ATen composition's Python launch cost, many times its GPU time, and picks kernels
    slower on the GPU than cuBLAS + the chain. In a CUDA graph (decode's usual home) only GPU time
    counts.
    Long GEMMs (ATen over SUSTAINED_MS): GPU time of calls back to back too, the regime of a
    training or serving loop: do_bench's short bursts, with an L2 flush between calls, can rate two
    kernels level that differ back to back, and so pick the one slower in use.
    Decode-size cases (M <= DECODE_M_ROWS) where ATen wins on GPU time then weigh host time too
    (_with_host_time)."""
    outs = case.new_outputs()
    tuning.precompile(cands, lambda cfg: make_case().launch(cfg, outs, warmup=True))
    small = case.M <= SMALL_M_ROWS
    time_fn = tuning.gpu_ms if small else tuning.bench_ms
    aten_ms = time_fn(reference_fn)
    note = "GPU time" if small else ""
    if not small and aten_ms > SUSTAINED_MS:
        time_fn, note = tuning.gpu_ms, "GPU time, back to back"
        aten_ms = time_fn(reference_fn)
    timings.append(["aten", round(aten_ms, 5), note])
    best = tuning.fastest(f"{case.kernel_name} M{case.M} N{case.N} K{case.K}", cands,
                         lambda cfg: time_fn(lambda: make_case().launch(cfg, outs)),
                         best=None, best_ms=aten_ms, timings=timings)
    if best is None and case.M <= DECODE_M_ROWS and steady is not None:
        best = _with_host_time(aten_ms, reference_fn, steady, timings)
    return best


def _with_host_time(aten_ms: float, reference_fn, steady, timings: list) -> tuple | None:
    """A decode-size case that ATen won on GPU time: the fastest config instead where its GPU time
    plus its host time per call is below ATen's. A decode step runs its calls either captured in a
    CUDA graph (GPU time alone counts) or plainly, where the host is the bottleneck and each call
    costs its host time: the sum weighs both regimes. At M1 a call's host time exceeds its GPU
    time, and cuBLAS + a chain of ATen ops costs the host more than a kept plan's direct launch."""
    tried = [(ms, tuple(cfg)) for cfg, ms, _ in timings if isinstance(cfg, tuple) and ms is not None]
    if not tried:
        return None
    cfg_ms, cfg = min(tried)
    aten_host, cfg_host = tuning.host_ms(reference_fn), tuning.host_ms(steady(cfg))
    timings += [["aten", round(aten_host, 5), "host time per call"], [cfg, round(cfg_host, 5), "host time per call"]]
    if cfg_ms + cfg_host >= aten_ms + aten_host:
        return None
    timings.append(["decided by", None,
                    f"chosen on GPU + host time per call, {(cfg_ms + cfg_host) * 1e3:.1f} against "
                    f"ATen's {(aten_ms + aten_host) * 1e3:.1f} us (on the GPU alone ATen is faster, "
                    f"{aten_ms * 1e3:.1f} against {cfg_ms * 1e3:.1f} us)"])
    return cfg


def cutlass_configs(m: int) -> list[tuple]:
    """The CUTLASS configs for m rows: none for decode steps (m <= cutlass.SMALL_MIN_M, the
    Triton configs serve those), cutlass.SMALL up to SMALL_M_ROWS, LARGE above."""
    if m <= cutlass.SMALL_MIN_M:
        return []
    return list(cutlass.SMALL if m <= SMALL_M_ROWS else cutlass.LARGE)


def cutlass_candidates(case: _Case, timings: list | None = None) -> list[tuple]:
    """The CUTLASS configs a case may time: cutlass_configs(M), unless XACCEL_CUTLASS=0 or the
    case or this machine rules them out (the reason then goes into `timings`, the tuning entry's
    report)."""
    if config.current().cutlass == "0" or not cutlass_configs(case.M) or not case.a2.is_cuda or interpreting():
        return []
    why = case.cutlass_reason
    tools = cutlass.toolchain()
    why = why or (tools if isinstance(tools, str) else None)
    if why is not None:
        if timings is not None:
            timings.append(["cutlass", None, why])
        return []
    return cutlass_configs(case.M)


def _resolved(case: _Case, cfgs) -> bool:
    """Whether every CUTLASS build for `cfgs` has finished (built or failed), in any process."""
    return all(cutlass.state(*case.cutlass_source(tuple(c))) in ("built", "failed") for c in cfgs)


def choose(case: _Case, reference_fn, make_case, steady=None) -> tuple[tuple | None, list, str]:
    """(config or None for ATen, CUTLASS configs still building, a note for reports on why a
    decode-size case took a config slower on the GPU than ATen, else ""). With XACCEL_CUTLASS=1 a case is
    tuned without the CUTLASS kernels that are not built yet, their builds start in the background
    (inside a tuning.trial(): at the case's next call after it) and the decision records them as
    pending; once they are all built (or failed) the stored decision no longer counts and the case
    is timed again, with them. steady(cfg): a call of a
    config as it runs once decided (for the host time of decode-size cases, _tune)."""
    if interpreting():
        return INTERPRETER, [], ""
    cands = [c for c in candidates(case.M, case.ep.num_accs, case.dtype, case.N) if case.usable(c)]
    cut_note: list = []
    cut = cutlass_candidates(case, cut_note)

    def known(e) -> bool:  # a stored decision for one of today's candidates (else: retune)
        cfg = e.get("config", "bad") if isinstance(e, dict) else "bad"
        return cfg is None or (isinstance(cfg, list) and tuple(cfg) in cands + cut)

    def valid(e) -> bool:  # ... and none of its CUTLASS builds has finished since
        return known(e) and not (e.get("pending") and _resolved(case, e["pending"]))

    def tune():
        timings = list(cut_note)  # why CUTLASS is out, if it is
        if cut and config.current().cutlass == "wait":
            cutlass.build_all([case.cutlass_source(c) for c in cut], f"{case.kernel_name} M{case.M}")
        pending = [c for c in cut if not _resolved(case, [c])]
        best = _tune(case, reference_fn, cands + [c for c in cut if c not in pending], make_case, timings, steady)
        return {"config": list(best) if best else None, "timings": timings, "pending": [list(c) for c in pending]}

    # untimed (XACCEL_TUNE=0): a stored decision, else the shape class's first config
    decision = tuning.decide(case.tuning_key(), untimed=list(cands[0]) if cands else None, valid=valid, usable=known,
                             tune=tune)
    cfg = tuple(decision.config) if decision.config else None
    if not decision.live:
        return cfg, [], ""
    pending = [tuple(c) for c in decision.entry.get("pending") or ()]
    if not tuning.in_trial():  # (in a trial, the case's next call starts them: _pending_done)
        for c in pending:
            cutlass.start_build(*case.cutlass_source(c))  # no-op when built, failed or building elsewhere
    note = next(("; " + why for c, _, why in decision.entry.get("timings") or () if c == "decided by"), "")
    return cfg, pending, note


_DECISIONS: dict = {}
_PENDING: dict = {}  # key -> (next poll time, the case's pending CUTLASS sources)
POLL_S = 2.0


def _pending_done(key) -> bool:
    """True once the background CUTLASS builds of a case have all finished (checked every POLL_S)."""
    next_poll, sources = _PENDING[key]
    now = time.monotonic()
    if now < next_poll:
        return False
    _PENDING[key] = (now + POLL_S, sources)
    states = [cutlass.state(*src) for src in sources]
    if all(st in ("built", "failed") for st in states):
        del _PENDING[key]
        return True
    if tuning.in_trial():
        return False
    for src, st in zip(sources, states):
        if st == "absent":  # deferred (a free build slot, a trial run), or its build died: start it now
            cutlass.start_build(*src)
    return False


def describe(cfg, pending: int = 0) -> str:
    """What a tuning decision runs, in words, for reports."""
    if cfg is None:
        what = "ATen (cuBLAS, then the chain)"
    elif cfg[0] in cutlass.VARIANTS:
        kind = "ping-pong" if cfg[0] == "cutlass_pp" else "cooperative"
        what = f"CUTLASS {kind} {cfg[1]}x{cfg[2]}x{cfg[3]}, cluster {cfg[4]}x{cfg[5]}"
    else:
        what = f"Triton {cfg[0]} {cfg[1]}x{cfg[2]}x{cfg[3]}"
    if pending:
        what += f"; {pending} CUTLASS configs still building (timed again once built)"
    return what


def settle(timeout_s: float = cutlass.BUILD_TIMEOUT_S) -> int:
    """Wait until every background CUTLASS build this process is waiting for has finished, and
    make the next call of each such case retune; returns how many cases that is. For benchmarks:
    time the steady state, not a retune in the middle of a timing."""
    keys = list(_PENDING)
    t0 = time.monotonic()
    for key in keys:
        for src in _PENDING[key][1]:
            try:
                cutlass.wait_built(*src, timeout_s=max(0.0, timeout_s - (time.monotonic() - t0)))
            except cutlass.CutlassBuildError:
                pass  # failed, or still building at the timeout: the case's next call decides, as for any poll
        _PENDING[key] = (0.0, _PENDING[key][1])  # polled at the next call
    return len(keys)


def _int32_reach(a, bs, operands, b_transposed) -> bool:
    """Whether every element the kernels address lies below 2^31 elements from its tensor's start
    (the kernels compute offsets in int32: an LM head at 64K tokens x 50K vocab, 3.3e9 outputs,
    would wrap around)."""
    N = bs[0].shape[0] if b_transposed else bs[0].shape[1]
    return max([a.numel() // a.shape[-1] * N, *(reach(t) for t in (a, *bs, *operands))]) < INT32_LIMIT


class _Plan:
    """A decided Triton config's launch for one case and one set of input strides, prepared once:
    per call only the input views, the outputs and the launch remain. A decode token runs many
    GEMM chains, and without a plan each pays the host time of _Case, the int32 reach check and
    launch() on every call, which a host-bound decode step feels. Built only where every input is
    a view of the caller's tensor (no contiguous copy of B) and the config is a Triton one; a TMA
    config checks the 16-byte alignment that its descriptors need on every call. A kept plan
    launches its compiled kernel directly from its second call (codegen/triton_launch.py).
    _Case.launch runs its Triton configs through a fresh plan too: the kernel's argument layout
    lives here only."""

    __slots__ = ("cfg", "kernel", "grid", "launcher", "meta", "M", "N", "K", "out_shape", "op_shapes", "n_out",
                 "dtype", "tail", "tma", "blocks", "direct")

    def __init__(self, case: "_Case", cfg: tuple, kept: bool = False):
        variant, bm, bn, bk, gm, warps, stages, flatten = cfg
        _, kernel = _kernel(case.epilogue, len(case.ops), case.precision, variant, case.b_transposed)
        tiles = triton_cdiv(case.M, bm) * triton_cdiv(case.N, bn)
        self.cfg, self.M, self.N, self.K, self.out_shape = cfg, case.M, case.N, case.K, case.out_shape
        self.op_shapes = [t.shape for t in case.ops]
        self.n_out, self.dtype = len(case.ep.outputs), case.dtype
        self.meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps, num_stages=stages)
        self.tma = variant != "ptr"
        if self.tma:  # persistent: one program per SM at most
            n_sms = _num_sms(case.device)
            self.meta.update(NUM_SMS=n_sms, FLATTEN=bool(flatten))
            self.blocks = ([bm, bk], [bn, bk] if case.b_transposed else [bk, bn])
            self.grid = (min(n_sms, tiles),)
            self.tail = (case.M, case.N, case.K, *case.op_strides, case.N, 1)
        else:
            self.grid = (tiles,)
            self.tail = (case.M, case.N, case.K, case.a2.stride(0), case.a2.stride(1), *case.b_strides,
                         *case.op_strides, case.N, 1)
        self.kernel, self.launcher = kernel, kernel[self.grid]
        # a kept plan's compiled kernel after its first launch, then launched without JITFunction.run
        # (None: not captured yet; False: not kept, or nothing to capture)
        self.direct = None if kept else False

    def __call__(self, a, bs, operands):
        """The outputs, or None where this call's tensors break the plan (TMA alignment)."""
        a2 = a.view(self.M, self.K)
        ops = [t.view(shape) for t, shape in zip(operands, self.op_shapes)]
        if self.tma and (a2.data_ptr() % 16 or any(b.data_ptr() % 16 for b in bs)):
            return None
        outs = [torch.empty((self.M, self.N), dtype=self.dtype, device=a.device) for _ in range(self.n_out)]
        self.launch(a2, bs, ops, outs)
        return [o.view(self.out_shape) for o in outs]

    def launch(self, a2, bs, ops, outs, warmup: bool = False) -> None:
        """The kernel's launch on a2 [M, K], bs and the operands' views into outs (also _Case's);
        warmup: only compile it (Triton's warmup run, no launch)."""
        if self.tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            a_block, b_block = self.blocks
            args = (TensorDescriptor(a2, [self.M, self.K], list(a2.stride()), a_block),
                    *(TensorDescriptor(b, list(b.shape), list(b.stride()), b_block) for b in bs),
                    *ops, *outs, *self.tail)
        else:
            args = (a2, *bs, *ops, *outs, *self.tail)
        if warmup:
            self.kernel.run(*args, grid=self.grid, warmup=True, **self.meta)
            return
        varying = (a2, *bs, *ops)  # the plan fixes the integers and constexprs; outs are new, of its dtype
        direct = self.direct
        if direct and direct.matches(varying):
            direct(args)
            return
        compiled = self.launcher(*args, **self.meta)
        if direct is None:
            self.direct = DirectLaunch.capture(self.kernel, compiled, self.grid, self.meta, len(args), varying) or False


_PLANS: dict = {}  # (case key, input strides) -> _Plan
MAX_PLANS = 4096  # cases are keyed by exact shapes: a server seeing many batch sizes starts over here


def _plan_key(key, a, bs, operands) -> tuple:
    """The case key plus what a plan fixes beyond it: the inputs' strides, the device (its SM count
    sizes a persistent grid) and, for fp32, whether TF32 is allowed (the kernel's precision)."""
    return (key, a.device, a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32, a.stride(),
            *(b.stride() for b in bs), *(t.stride() for t in operands))


def _make_plan(case: "_Case", cfg: tuple, a, bs, operands) -> "_Plan | None":
    """A plan for this decided case, or None where one would not reproduce _Case's launch."""
    if cfg[0] in cutlass.VARIANTS or any(x is not y for x, y in zip(case.bs, bs)):
        return None  # CUTLASS (launched through its library), or B needed a contiguous copy
    try:  # every input must be a view of the caller's tensor, as _Case's reshapes made it
        a.view(case.M, case.K)
        for t, t2 in zip(operands, case.ops):
            if t.view(t2.shape).data_ptr() != t2.data_ptr():
                return None
    except RuntimeError:
        return None
    return _Plan(case, cfg, kept=True)


def _steady_call(cfg: tuple, a, bs, operands, epilogue, b_transposed):
    """A call of a decided config as the provider then makes it: through a kept plan where one
    applies (launched directly from its second call), else prepared per call through _Case."""
    case = _Case(a, bs, operands, epilogue, b_transposed)
    plan = _make_plan(case, cfg, a, bs, operands)
    if plan is not None:
        return lambda: plan(a, bs, operands)

    def call():
        c = _Case(a, bs, operands, epilogue, b_transposed)
        c.launch(cfg, c.new_outputs())
    return call


class _AtenPlan:
    """A host-bound case that tuning gave to ATen (decision None): straight to the composition,
    past the provider's checks. At M1 most of a decode step's chains are such cases (cuBLAS's
    GEMV, then the chain node by node)."""

    __slots__ = ("epilogue", "b_transposed")
    cfg = None  # the decision it stands for

    def __init__(self, epilogue: str, b_transposed: bool):
        self.epilogue, self.b_transposed = epilogue, b_transposed

    def __call__(self, a, bs, operands):
        return reference.aten_composition(a, bs, operands, self.epilogue, self.b_transposed)


def _keep_plan(key, a, bs, operands, plan) -> None:
    remember(_PLANS, _plan_key(key, a, bs, operands), plan, MAX_PLANS)


def provider(key, a, bs, operands, epilogue, b_transposed):
    plan = _PLANS.get(_plan_key(key, a, bs, operands))
    if plan is not None and _DECISIONS.get(key, "unset") is plan.cfg and key not in _PENDING:
        out = plan(a, bs, operands)
        if out is not None:
            runtime.note_use(key)
            return out
    if a.dtype not in DTYPES or any(b.dim() != 2 for b in bs) or a.numel() == 0 or bs[0].numel() == 0:
        return NotImplemented
    if a.dtype == torch.bfloat16 and interpreting():
        return NotImplemented  # Triton's interpreter computes bf16 dots wrongly: the reference runs
    aten_composition = reference.aten_composition

    if not _int32_reach(a, bs, operands, b_transposed):
        return aten_composition(a, bs, operands, epilogue, b_transposed)  # cuBLAS takes 64-bit sizes

    runtime.note_use(key)
    if key in _PENDING and not (a.is_cuda and torch.cuda.is_current_stream_capturing()) and _pending_done(key):
        _DECISIONS.pop(key, None)  # its CUTLASS kernels are built: time the case again, with them
    cfg = _DECISIONS.get(key, "unset")
    if cfg is None:  # tuning timed ATen faster here
        if key not in _PENDING:
            _keep_plan(key, a, bs, operands, _AtenPlan(epilogue, b_transposed))
        return aten_composition(a, bs, operands, epilogue, b_transposed)
    if cfg == "unset" and a.is_cuda and torch.cuda.is_current_stream_capturing():
        # no timing inside a CUDA-graph capture: ATen now, tune on an uncaptured call
        return aten_composition(a, bs, operands, epilogue, b_transposed)
    case = _Case(a, bs, operands, epilogue, b_transposed)
    if cfg == "unset":
        cfg, pending, note = choose(case, lambda: aten_composition(a, bs, operands, epilogue, b_transposed),
                                    lambda: _Case(a, bs, operands, epilogue, b_transposed),
                                    lambda c: _steady_call(c, a, bs, operands, epilogue, b_transposed))
        _DECISIONS[key] = cfg
        if pending:
            _PENDING[key] = (time.monotonic() + POLL_S, [case.cutlass_source(c) for c in pending])
        runtime.record_choice(key, "gemm_epilogue", case.label(), describe(cfg, len(pending)) + note)
    if cfg is None or not case.usable(cfg):
        # tuning timed ATen faster for this shape class, or this call's strides/alignment rule out
        # the TMA kernel tuned on an earlier call with the same shapes
        return aten_composition(a, bs, operands, epilogue, b_transposed)
    outs = case.new_outputs()
    case.launch(cfg, outs)
    if key not in _PENDING:  # (a call of a large GEMM may be host-bound too: a model full of them can be)
        plan = _make_plan(case, cfg, a, bs, operands)
        if plan is not None:
            _keep_plan(key, a, bs, operands, plan)
    return [o.view(case.out_shape) for o in outs]
