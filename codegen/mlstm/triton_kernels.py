"""Generated Triton kernels for xaccel::mlstm (forward, backward) and xaccel::mlstm_step, rendered
from templates/mlstm_*.py.jinja per input dtype (and initial state or not, where it matters);
head dims, chunk length and tiles are compile-time constants.

The chunkwise form is split so that only the state scans are sequential: the state entering every
chunk (mlstm_chunk_states) and then every chunk's output in parallel (mlstm_fwd); the backward adds
mlstm_bwd_rows (per-row normalizer terms), the reverse state-gradient scan (mlstm_bwd_states) and
mlstm_bwd (every chunk's gradients in parallel). Configs (configs.py) are tuned once per shape
class (_tuned)."""
from __future__ import annotations

import contextvars
import functools
import hashlib
from pathlib import Path

import torch

from torch_xaccel.ops.mlstm import gradient_like, h_like, kept_shapes
from torch_xaccel.runtime import interpreting

from .. import cache, precision as fp32_dots, tuning
from ..limits import INT32_LIMIT, reach
from ..render import Templates
from ..triton_launch import LaunchCache, remember
from . import configs

TEMPLATES = Templates(Path(__file__).parent / "templates")
_KERNELS: dict = {}


def _render(template: str, dtype: torch.dtype, s_constexpr: bool, precision: str | None = None,
            **extra) -> tuple[str, str]:
    """(kernel name, source) of one mLSTM template for the dot dtype. s_constexpr: sequence length
    and chunk count as compile-time constants, for Triton 3.6's interpreter (it cannot loop to a
    run-time bound under NumPy 2). precision: the dots' input_precision (default: what torch's
    float32 matmul setting allows now, precision.dot_precision); part of the name."""
    precision = precision or fp32_dots.dot_precision(dtype)
    key = f"{template}|{dtype}|{precision}|{s_constexpr}|{sorted(extra.items())}"
    name = template.split(".")[0] + "_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    masks = _mask_text(bool(extra.get("pad_k")), bool(extra.get("pad_v")))
    src = TEMPLATES.render(template, kernel_name=name, dot_dtype=str(dtype), precision=precision,
                           s_constexpr=s_constexpr, **masks, **extra)
    return name, src


def _mask_text(pad_k: bool, pad_v: bool) -> dict:
    """The templates' mask texts for a padded head (empty for an unpadded one): mk / mv the column
    masks of q, k / v, dh, h tiles; sk / skv the masks of state loads (n rows; C tiles [DK, DV]),
    which must not read the tiles past the true head dims that no scan program writes
    (_state_grid); dk_end / dv_end the bounds of loops over DK / DV tiles, so that no tile past the
    true dims runs."""
    rows, cols = "(offs_k < DKR)[:, None]", "(offs_v < DVR)[None, :]"
    tile = " & ".join(m for m, on in ((rows, pad_k), (cols, pad_v)) if on)
    return dict(mk=" & (offs_k < DKR)[None, :]" if pad_k else "",
                mv=" & (offs_v < DVR)[None, :]" if pad_v else "",
                sk=", mask=offs_k < DKR, other=0.0" if pad_k else "",
                skv=f", mask={tile}, other=0.0" if tile else "",
                dk_end="DKR" if pad_k else "DK", dv_end="DVR" if pad_v else "DV")


def _kernel(template: str, dtype: torch.dtype, **extra):
    """The kernel of one template and variant at the dots' precision in force now."""
    precision = fp32_dots.dot_precision(dtype)
    key = (template, dtype, precision, interpreting(), tuple(sorted(extra.items())))
    if key not in _KERNELS:
        name, src = _render(template, dtype, interpreting(), precision, **extra)
        _KERNELS[key] = getattr(cache.load_source(name, src), name)
    return _KERNELS[key]


_WARMUP = contextvars.ContextVar("xaccel_mlstm_warmup", default=False)


_LAUNCHES = LaunchCache()


def _launch(kernel, grid, *args, slot=None, **meta):
    """kernel[grid](*args, **meta), or only its compile while tuning precompiles candidates.
    slot: (LaunchCache, key, the tensors among args) of a kept plan's launch (_Launches), which
    fixes every other argument: from its second call, its compiled kernel directly; without one,
    the same from a key made of the call (LaunchCache.launch_any)."""
    if _WARMUP.get():
        kernel.run(*args, grid=grid, warmup=True, **meta)
    elif slot is not None:
        cache, key, tensors = slot
        cache.launch(key, kernel, grid, args, meta, tensors)
    else:
        _LAUNCHES.launch_any(kernel, grid, args, meta)


def _warmup(launch, cfg) -> None:
    """Compile every kernel of one phase for `cfg` without launching any (the torch ops between
    them still run, on uninitialised buffers)."""
    token = _WARMUP.set(True)
    try:
        launch(cfg)
    finally:
        _WARMUP.reset(token)


_CHOSEN: dict = {}  # tuning key -> decision, for this process


def _tuned(phase: str, q: torch.Tensor, v: torch.Tensor, launch, kept: bool = False, chunk: int | None = None) -> dict:
    """The fastest candidate for this phase and shape class, timed once (launch(cfg) runs the
    phase) and stored like every tuning decision (tuning.decide: with XACCEL_TUNE=0, a stored
    decision or the default); without CUDA, the default. kept: a saving forward (its configs at
    the kept states' chunk length `chunk`) or a backward that reads the kept states (no scan):
    their own decisions, since that changes what is timed."""
    B, H, S = q.shape[:3]
    DK, DV = configs.padded(q.shape[-1]), configs.padded(v.shape[-1])
    size = q.element_size()
    config, candidates = ((configs.forward_config, configs.forward_candidates) if phase == "fwd"
                          else (functools.partial(configs.backward_config, kept=kept),
                                functools.partial(configs.backward_candidates, kept=kept)))
    if chunk is not None:
        config, candidates = configs.at_chunk(config, chunk), configs.at_chunk(candidates, chunk)
    if interpreting() or q.device.type != "cuda":
        return config(DK, DV, size)
    key = _tuning_key(phase, q, v, kept, chunk)
    if key in _CHOSEN:
        return _CHOSEN[key].config
    default, cands = config(DK, DV, size), candidates(DK, DV, size)  # only on a memo miss
    label = f"mlstm {phase} S{S} DQK{DK} DV{DV}"

    def tune():
        timings = []
        return {"config": _fastest(label, default, cands, launch, timings), "timings": timings}
    return tuning.decide(key, untimed=default, valid=lambda e: isinstance(e, dict) and e.get("config") in cands,
                         tune=tune, memo=_CHOSEN).config


def _tuning_key(phase: str, q: torch.Tensor, v: torch.Tensor, kept: bool = False, chunk: int | None = None) -> str:
    """The tuning key of a phase's shape class: dtype, head dims, S and B*H to the next power of
    two; for fp32 also the dots' precision (a decision at TF32 does not hold at 3xTF32; the
    16-bit keys are as before)."""
    B, H, S = q.shape[:3]
    dots = f"|{fp32_dots.dot_precision(q.dtype)}" if q.dtype == torch.float32 else ""
    parts = (f"mlstm_{phase}{'|kept' if kept else ''}{chunk or ''}|{q.dtype}{dots}|DK{q.shape[-1]}|DV{v.shape[-1]}|"
             f"S~{1 << (S - 1).bit_length()}|BH~{1 << (B * H - 1).bit_length()}")
    return tuning.key("mlstm", parts, q.device, TEMPLATES.digest)


def _fastest(label: str, default: dict, cands: list[dict], launch, timings: list) -> dict:
    """The fastest candidate; a config must first reproduce the outputs of the reference config
    (each of _compared's, within 1e-2 or 2e-2) before its speed counts. The reference is the
    first config of an original kernel (whole-tile forward, single per-chunk backward:
    _newer_kernel) that runs: the sliced kernel (SLICED) had a version that Triton miscompiled
    on Hopper while the interpreter agreed, so newer variants are checked, not trusted; without
    an original config, the first that runs. No candidate runs: raise (the runtime falls back to
    the reference and says why)."""
    tuning.precompile(cands, lambda cfg: _warmup(launch, cfg))
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
        return tuning.bench_ms(lambda: launch(cfg), warmup=3, rep=15)
    return tuning.fastest(label, cands, bench, best=ref, timings=timings)


def _compared(outputs) -> list:
    """What the agreement check compares: every output of the forward (h and the final state)
    or every input gradient of the backward (dq, dk, dv, di, df: each comes from a different
    kernel of the split backward), finite parts only (degenerate inputs). h and dq within 1e-2,
    the others within 2e-2, since two right bf16 configs each carry up to ~3e-3 of their own
    error there (GPU tests) and a broken kernel is off by far more. Not the
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
    if q.dtype == torch.bfloat16 and interpreting():
        return False  # Triton's interpreter computes bf16 dots wrongly: the reference runs
    if _uncovered(q.dtype, k.dtype, v.dtype, DK, DV) or not (S > 0 and max(q.numel(), v.numel()) < INT32_LIMIT):
        return False  # (int32 offsets: larger tensors run the reference)
    return interpreting() or configs.any_config_fits(phase, configs.padded(DK), configs.padded(DV), q.element_size())


def why_not(q, k, v) -> str | None:
    """For the lowering, on tensors or their fake values: why the kernels would not run this case
    on its CUDA device (None: they would, or the tensors are not on a CUDA device)."""
    if q.device.type != "cuda":
        return None
    return why_not_on_cuda(q.dtype, k.dtype, v.dtype, q.shape[-1], v.shape[-1])


def _uncovered(q_dtype, k_dtype, v_dtype, DK: int, DV: int) -> str | None:
    """Why the templates do not cover these dtypes and head dims (None: they do)."""
    if q_dtype not in configs.DTYPES or k_dtype != q_dtype or v_dtype != q_dtype:
        return f"no mLSTM kernel for {q_dtype} / {k_dtype} / {v_dtype}"
    if configs.padded(DK) is None or configs.padded(DV) is None:
        return f"no mLSTM kernel for head dims {DK}/{DV} (the kernels take head dims up to {configs.HEAD_DIMS[-1]})"
    return None


def why_not_on_cuda(q_dtype, k_dtype, v_dtype, DK: int, DV: int) -> str | None:
    uncovered = _uncovered(q_dtype, k_dtype, v_dtype, DK, DV)
    if uncovered:
        return uncovered
    if not configs.any_config_fits("fwd", configs.padded(DK), configs.padded(DV), q_dtype.itemsize):
        return f"no mLSTM kernel configuration fits head dims {DK}/{DV} in {q_dtype}"
    return None


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t itself when the kernels can read it in place (unit stride along the head dim; the gates
    [B, H, S] take any strides), else a contiguous copy: the usual transposed projections
    ([B, S, H, D] viewed as [B, H, S, D]) then cost no copy in the forward or the backward.
    Also a copy when its farthest element lies 2^31 or more elements from its start (e.g. q
    sliced from a wide fused projection): the kernels compute offsets in int32."""
    if (t.dim() == 4 and t.stride(-1) != 1) or t.numel() == 0:
        return t.contiguous()
    return t if reach(t) <= INT32_LIMIT else t.contiguous()


def _rows(*ts: torch.Tensor) -> list[int]:
    """The kernels' row_args: the head count, then each tensor's batch, head and position strides."""
    return [ts[0].shape[1]] + [st for t in ts for st in t.stride()[:3]]


class _Launches:
    """A plan's kernel launches, each with its grid, constexprs and trailing scalars fixed when the
    plan is made: a call passes only the tensors, which come first in every mLSTM kernel's
    arguments. A kept plan (the provider's, one per case) launches each compiled kernel directly
    from its second call (a LaunchCache keyed by the launch's place in the plan)."""

    __slots__ = ("specs", "direct")

    def __init__(self, kept: bool):
        self.specs, self.direct = [], LaunchCache() if kept else None

    def add(self, kernel, grid: tuple, tail: tuple, meta: dict) -> int:
        self.specs.append((kernel, grid, tuple(tail), meta))
        return len(self.specs) - 1

    def __call__(self, n: int, tensors: tuple) -> None:
        kernel, grid, tail, meta = self.specs[n]
        _launch(kernel, grid, *tensors, *tail, slot=(self.direct, n, tensors) if self.direct else None, **meta)


class _ScanPlan:
    """The sequential scan of one config and case (k, v, i, f's shapes and strides, a start state or
    none): mlstm_chunk_gates prepares every chunk's gate terms in parallel, then
    mlstm_chunk_states walks the chunks with one matmul per step. States at the kernels' head dims
    (_head: C0 and n0 padded to them)."""

    def __init__(self, cfg: dict, k, v, i, f, has_state: bool, launches: _Launches):
        B, H, S = k.shape[:3]
        dims = _head(k, v)
        DK, DV, scale = dims["DK"], dims["DV"], dims["DKR"] ** -0.5
        L, BK, BVS = cfg["L"], cfg["BK"], cfg["BVS"]
        NC = -(-S // L)
        if B * H * NC * DK * DV >= INT32_LIMIT:  # the kernels' offsets are int32: this config cannot run here
            raise ValueError(f"mLSTM chunk states at chunk {L} would hold {B * H * NC * DK * DV} elements (>= 2^31)")
        self.sizes = (B * H * NC * DK * DV, B * H * NC * DK, B * H * NC, (B, H, DK, DV), (B, H, DK), (B, H),
                      B * H * NC * L, B * H * NC * 2)
        self.has_state, self.launches = has_state, launches
        self.gates = launches.add(_kernel("mlstm_chunk_gates.py.jinja", k.dtype), (B * H, NC),
                                  (*_rows(i, f), S, NC), dict(L=L))
        self.scan = launches.add(
            _kernel("mlstm_chunk_states.py.jinja", k.dtype, has_state=has_state, loads_first=bool(cfg.get("LF")),
                    **_masks(dims)),
            _state_grid(B * H, dims, BK, BVS), (*_rows(k, v), S, NC, scale),
            dict(**dims, BK=BK, BV=BVS, L=L, num_warps=configs.scan_warps(cfg), num_stages=cfg["stages"]))

    def __call__(self, k, v, i, f, C0, n0, m0):
        """(Cs, ns, ms) the state entering each chunk ([B*H*NC*DK*DV] in the input dtype, [.. DK]
        and [..] fp32) and the final state (C, n, m) in fp32."""
        dev, f32 = k.device, torch.float32
        cs, ns_, ms_, c, n_, m_, g, g2 = self.sizes
        Cs, ns = _state_buffer(cs, k.dtype, dev), _state_buffer(ns_, f32, dev)
        ms = torch.empty(ms_, dtype=f32, device=dev)
        C, n = _state_buffer(c, f32, dev), _state_buffer(n_, f32, dev)
        m = torch.empty(m_, dtype=f32, device=dev)
        if self.has_state:
            C0, n0, m0 = C0.float().contiguous(), n0.float().contiguous(), m0.float().contiguous()
        else:
            C0, n0, m0 = C, n, m  # unused by the kernel
        # each chunk's gate terms, in parallel, off the sequential scan
        gates = (torch.empty(g, dtype=f32, device=dev), torch.empty(g2, dtype=f32, device=dev))
        self.launches(self.gates, (i, f, *gates))
        self.launches(self.scan, (k, v, C0, n0, m0, Cs, ns, ms, C, n, m, *gates))
        return (Cs, ns, ms), (C, n, m)


def chunk_states(k, v, i, f, C0, n0, m0, cfg):
    """The sequential scan of one call (_ScanPlan): ((Cs, ns, ms), (C, n, m))."""
    return _ScanPlan(cfg, k, v, i, f, C0 is not None, _Launches(kept=False))(k, v, i, f, C0, n0, m0)


class _ForwardPlan:
    """One forward config's work for one case: the inputs' shapes and strides, a start state or
    none, eps, h's layout, saving or not. Everything that follows from those (which inputs need a
    contiguous copy, the kernels, grids, strides and constexprs) is worked out once, so a call only
    makes those copies, allocates its outputs and launches three kernels. The provider keeps one
    per case (forward): a compiled model calls the op once per layer per step, and without a plan
    each call paid the checks, the tuning key and the launch keys again. Tuning runs each
    candidate through a plan made for the call.

    pad: the head dims' padding (_padding) applied to C0 and n0 per call, or None where the caller
    hands them over padded. save: also return the state entering each chunk and each row's
    (den_t, m_t) [B*H, 2, S] fp32 (kept_shapes' views)."""

    def __init__(self, cfg: dict, q, k, v, i, f, has_state: bool, eps: float, seq_major_h: bool, save: bool,
                 chunk_size: int | None, pad, kept: bool):
        xs = tuple(_strided(t) for t in (q, k, v, i, f))
        self.copies = tuple(x is not t for x, t in zip(xs, (q, k, v, i, f)))
        q, k, v, i, f = xs
        B, H, S = q.shape[:3]
        dims = _head(q, v)
        self.DKR, self.DVR, self.padded_head = dims["DKR"], dims["DVR"], dims["DK"] != dims["DKR"] or \
            dims["DV"] != dims["DVR"]
        self.launches = _Launches(kept)
        self.scan = _ScanPlan(cfg, k, v, i, f, has_state, self.launches)
        self.seq_major_h, self.save, self.pad = seq_major_h, save, pad
        self.rows_size = B * H * 2 * S if save else 0
        self.kept_shapes = [shape for shape, _ in kept_shapes(q, v, chunk_size)] if save else None
        h_meta = h_like(torch.empty(q.shape, dtype=q.dtype, device="meta"), torch.empty(v.shape, device="meta"),
                        seq_major_h)
        L = cfg["L"]
        NC = -(-S // L)
        meta = dict(**dims, BV=cfg["BV"], L=L, num_warps=cfg["warps"], num_stages=cfg["stages"])
        if cfg.get("BKQ"):  # the sliced output kernel (SLICED)
            meta["BKQ"] = cfg["BKQ"]
        self.out = self.launches.add(
            _kernel("mlstm_fwd.py.jinja", q.dtype, k_loop=bool(cfg.get("BKQ")), save_rows=save, **_masks(dims)),
            (B * H * NC * _tiles(self.DVR, cfg["BV"]),),  # (flat: the templates' flat_ids)
            (*_rows(q, k, v, i, f, h_meta), S, NC, self.DKR ** -0.5, eps), meta)

    def __call__(self, q, k, v, i, f, C0, n0, m0):
        q, k, v, i, f = (t.contiguous() if copy else t for t, copy in zip((q, k, v, i, f), self.copies))
        if self.pad is not None and C0 is not None:
            C0, n0 = _pad(C0, *self.pad), _pad(n0, self.pad[0])
        (Cs, ns, ms), (C, n, m) = self.scan(k, v, i, f, C0, n0, m0)
        h = h_like(q, v, self.seq_major_h)
        if self.save:
            rows = torch.empty(self.rows_size, dtype=torch.float32, device=q.device)
            self.launches(self.out, (q, k, v, i, f, h, Cs, ns, ms, rows))
        else:
            self.launches(self.out, (q, k, v, i, f, h, Cs, ns, ms))
        if self.padded_head:
            C, n = C[..., :self.DKR, :self.DVR], n[..., :self.DKR]
        if self.save:
            return (h, C, n, m, *(t.view(shape) for t, shape in zip((Cs, ns, ms, rows), self.kept_shapes)))
        return h, C, n, m


_FORWARD_PLANS: dict = {}  # the case (shapes, strides, dtypes, flags, dots' precision, interpreter) -> plan or None
MAX_PLANS = 1024  # entries per plan table (triton_launch.remember)


def forward(key, q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h=False, save=False):
    """Kernel path for xaccel::mlstm's forward, or NotImplemented for cases it does not cover: the
    chunk-state scan, then every chunk's output in parallel. chunk_size only shapes the
    reference's evaluation; the kernels pick their own chunk length (results agree to rounding).
    save (xaccel::mlstm_saving): also return the state entering each chunk of chunk_size
    positions and each row's den_t and m_t, the forward then running at that chunk length (its
    own tuning decision), so that a backward walking the same chunks reads them.
    seq_major_h: h is written in the op's seq-major layout (ops/mlstm/op.h_like)."""
    plan_key = (q.device, q.dtype, q.shape, v.shape, q.stride(), k.stride(), v.stride(), i.stride(), f.stride(),
                i.dtype, f.dtype, C0 is None, seq_major_h, eps, chunk_size, save, fp32_dots.dot_precision(q.dtype),
                interpreting())
    plan = _FORWARD_PLANS.get(plan_key, False)
    if plan is False:
        plan = _forward_plan(q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h, save)
        if not tuning.capturing():  # (a decision made inside a capture is not kept: a later call tunes)
            remember(_FORWARD_PLANS, plan_key, plan, MAX_PLANS)
    if plan is None:
        return NotImplemented
    return plan(q, k, v, i, f, C0, n0, m0)


def _forward_plan(q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h, save) -> _ForwardPlan | None:
    """The tuned forward's plan for this case, or None where the kernels do not take it."""
    S = q.shape[2]
    if not _supported(q, k, v, S, "fwd") or \
            save and not configs.saving_forward_fits(q.shape[-1], v.shape[-1], q.element_size(), chunk_size):
        return None
    pad = _padding(q.shape[-1], v.shape[-1])
    if pad and save:  # (a saving forward's states would not have the op's shapes: the lowering asks for none here)
        return None

    def make(cfg, kept=False):
        return _ForwardPlan(cfg, q, k, v, i, f, C0 is not None, eps, seq_major_h, save, chunk_size, pad, kept)
    cfg = _tuned("fwd", q, v, lambda c: make(c)(q, k, v, i, f, C0, n0, m0),
                 kept=save, chunk=chunk_size if save else None)
    return make(cfg, kept=True)


def _padding(DK: int, DV: int) -> tuple[int, int] | None:
    """(DK, DV) columns by which a head dim between the kernels' sizes falls short of the size it
    runs at, else None. The kernels read such a head as if zero-padded (_head): zero q and k
    columns add nothing to q k^T, q.n or the states' rows, zero v columns give zero h and state
    columns, and the scale stays the true DK^-0.5. Only the states (C0, n0 and their gradients'
    inputs) are padded copies; the results are cut to the op's dims."""
    pk, pv = configs.padded(DK) - DK, configs.padded(DV) - DV
    return (pk, pv) if pk or pv else None


def _pad(t, *widths):
    """t zero-padded at the end of its last len(widths) dims (widths outermost first); None stays."""
    import torch.nn.functional as F

    if t is None or not any(widths):
        return t
    return F.pad(t, [p for w in reversed(widths) for p in (0, w)])


def _head(q, v) -> dict:
    """The kernels' head dims: DK, DV the tile sizes they run at (configs.padded), DKR, DVR the
    tensors' own. Loads of q, k, v, dh and h mask the columns past DKR / DVR to zero and stores of
    h, dq, dk, dv skip them, so a padded head costs no copy of those tensors."""
    DKR, DVR = q.shape[-1], v.shape[-1]
    return dict(DK=configs.padded(DKR), DV=configs.padded(DVR), DKR=DKR, DVR=DVR)


def _tiles(D: int, tile: int) -> int:
    """Tiles of a head dim D that hold its true columns: a padded head's last tiles hold none."""
    return -(-D // tile)


def _state_grid(programs: int, dims: dict, BK: int, BV: int) -> tuple[int]:
    """Flat grid of the state scans (mlstm_chunk_states, mlstm_bwd_states; the templates' flat_ids
    order): one program per state tile holding true columns. The tiles past them stay unwritten;
    every load of a state masks them."""
    return (programs * _state_tiles(dims, BK, BV),)


def _state_tiles(dims: dict, BK: int, BV: int) -> int:
    """State tiles per (batch*head) of the scans."""
    return _tiles(dims["DKR"], BK) * _tiles(dims["DVR"], BV)


def _state_buffer(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised state buffer. Under the interpreter it is filled with NaN, so a kernel
    reading a tile that no program wrote (a padded head's) turns the tests' results NaN."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if interpreting() else t


def _masks(dims: dict) -> dict:
    """The templates' switches for the column masks of a padded head (unpadded kernels have none)."""
    return dict(pad_k=dims["DK"] != dims["DKR"], pad_v=dims["DV"] != dims["DVR"])


def forward_saving(key, *args):
    """Kernel path for xaccel::mlstm_saving."""
    return forward(key, *args, save=True)


def backward_reads_kept_states(device_type: str, dtype: torch.dtype, DK: int, DV: int, chunk_size: int) -> bool:
    """Whether saving the chunk states in a training graph pays: the kernels run there (CUDA, or
    Triton's interpreter) and every backward config they may pick walks chunks of chunk_size, so
    the kept states replace the backward's scan. Else (the CPU reference, whose backward ignores
    them; fp32 from DQK 256, whose backward chunks are 16-32; a chunk size the kernels do not
    take) they would be held for nothing (lowering/mlstm/saving.py asks)."""
    if chunk_size not in configs.CHUNKS or dtype not in configs.DTYPES or DK not in configs.HEAD_DIMS \
            or DV not in configs.HEAD_DIMS:
        return False
    if not configs.saving_forward_fits(DK, DV, dtype.itemsize, chunk_size):
        return False  # the op would run its reference
    if interpreting():
        return (device_type == "cpu" and dtype != torch.bfloat16
                and configs.backward_config(DK, DV, dtype.itemsize)["L"] == chunk_size)
    cands = configs.backward_candidates(DK, DV, dtype.itemsize, kept=True)
    return device_type == "cuda" and bool(cands) and all(c["L"] == chunk_size for c in cands)


def _forward(cfg, q, k, v, i, f, C0, n0, m0, eps, seq_major_h=False, save=False, chunk_size=None):
    """One forward call at config `cfg` through a plan made for it (tests; C0 and n0 padded by the
    caller where the head is)."""
    if save:
        assert cfg["L"] == chunk_size, (cfg, chunk_size)
    return _ForwardPlan(cfg, q, k, v, i, f, C0 is not None, eps, seq_major_h, save, chunk_size, None,
                        kept=False)(q, k, v, i, f, C0, n0, m0)


def step(key, q, k, v, i, f, C, n, m, eps, scale_q=False):
    """Kernel path for xaccel::mlstm_step, or NotImplemented. Capturable in a CUDA graph (no host
    synchronisation, outputs allocated by the caching allocator)."""
    B, H, DK = q.shape
    DV = v.shape[-1]
    plan = _step_plan(q.dtype, k.dtype, v.dtype, B, H, DK, DV)
    if plan is None:
        return NotImplemented
    launch_key, kernel, meta, grid = plan
    q_scale, k_scale = (DK ** -0.5, 1.0) if scale_q else (1.0, DK ** -0.5)
    # a head dim between the kernels' sizes runs in the tiles of configs.padded, its columns past
    # the true dims masked: no padded copies of q, k, v or the state on a decode's hot path
    q, k, v, i, f = (t.contiguous() for t in (q, k, v, i, f))
    C, n, m = (t.float().contiguous() for t in (C, n, m))
    h = torch.empty(B, H, DV, dtype=q.dtype, device=q.device)
    C2, n2, m2 = torch.empty_like(C), torch.empty_like(n), torch.empty_like(m)
    # eps as a float: the compiled kernel's argument type must not depend on how a caller spelled it
    args = (q, k, v, i, f, C, n, m, h, C2, n2, m2, q_scale, k_scale, float(eps), DK, DV)
    # a decode step is host-bound: from the second call of a shape, its compiled kernel directly
    _STEP_LAUNCHES.launch((launch_key, q.dtype, q.device, B, H, DK, DV), kernel, grid, args, meta, args[:12])
    return h, C2, n2, m2


def _step_plan(q_dtype, k_dtype, v_dtype, B: int, H: int, DK: int, DV: int):
    """(kernel key, kernel, constexprs, grid) for a step case, or None where the kernel does not take it;
    remembered per case, since a decode calls one case per layer every token."""
    case = (q_dtype, k_dtype, v_dtype, B, H, DK, DV, interpreting())
    plan = _STEP_PLANS.get(case, False)
    if plan is not False:
        return plan
    plan = None
    if not (q_dtype == torch.bfloat16 and interpreting()) \
            and not _uncovered(q_dtype, k_dtype, v_dtype, DK, DV) \
            and B * H * configs.padded(DK) * configs.padded(DV) < INT32_LIMIT:  # int32 offsets into the state
        # (Triton's interpreter computes bf16 dots wrongly: the reference runs there)
        key = ("step", interpreting())
        if key not in _KERNELS:
            name = "mlstm_step_" + hashlib.sha256(b"mlstm_step|v3").hexdigest()[:12]
            src = TEMPLATES.render("mlstm_step.py.jinja", kernel_name=name)
            _KERNELS[key] = getattr(cache.load_source(name, src), name)
        DKP, DVP = configs.padded(DK), configs.padded(DV)
        BV = min(DVP, 64)
        plan = (key, _KERNELS[key], dict(DK=DKP, DV=DVP, BV=BV), (B * H, _tiles(DV, BV)))
    remember(_STEP_PLANS, case, plan, MAX_PLANS)
    return plan


_STEP_PLANS: dict = {}
_STEP_LAUNCHES = LaunchCache()  # keyed by (kernel key, dtype, device, B, H, DK, DV)


def backward(key, dh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size, h=None, kept=()):
    """Kernel path for xaccel::mlstm's backward (same contract as ops/mlstm/reference_backward.backward),
    or NotImplemented. In order: the chunk-state scan again (skipped when the forward kept its
    states, kept = [Cs, ns, ms, rows, C, n, m] at chunk_size, and the config's chunk is
    chunk_size), per-row normalizer terms (from the saved output h and, with kept states, the
    forward's den_t and m_t; else q k^T again; h recomputed when absent), the
    reverse state-gradient scan, then every chunk's dq, dk, dv and gate gradients in parallel.
    The eps term is routed through the stabilizer max in one kernel (route_max_grad)."""
    B, H, S, DK = q.shape
    DV = v.shape[-1]
    if not _supported(q, k, v, S, "bwd") or dh is None and gC is None:
        return NotImplemented
    dev, f32 = q.device, torch.float32
    q, k, v, i, f = (_strided(t) for t in (q, k, v, i, f))
    if h is None:
        h = forward(key, q, k, v, i, f, C0, n0, m0, eps, chunk_size)[0]
    h = _strided(h)
    dh = torch.zeros_like(h) if dh is None else _strided(dh)
    if gC is not None or gn is not None:  # (else the state scan starts from zero: final_grads off)
        gC = torch.zeros(B, H, DK, DV, device=dev, dtype=f32) if gC is None else gC.float().contiguous()
        gn = torch.zeros(B, H, DK, device=dev, dtype=f32) if gn is None else gn.float().contiguous()
    gm = torch.zeros(B, H, device=dev, dtype=f32) if gm is None else gm.float()
    padding = _padding(DK, DV)
    if padding:  # (no kept states: the lowering keeps none at a padded head)
        pk, pv = padding
        gC, gn, C0, n0, kept = _pad(gC, pk, pv), _pad(gn, pk), _pad(C0, pk, pv), _pad(n0, pk), ()
    kept = _kept_states(kept, q, v, chunk_size)
    cfg = _tuned("bwd", q, v, lambda c: _backward(c, dh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, h, kept),
                 kept=kept is not None)
    return _backward(cfg, dh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, h, kept)


def _kept_states(kept, q, v, chunk_size):
    """(chunk_size, (Cs, ns, ms) flat as chunk_states() returns them, rows flat, (C, n, m)) from
    the forward's kept states, or None when there are none or they do not have the layout the
    kernels read (then the backward reruns the scan and recomputes the row terms)."""
    if not kept:
        return None
    Cs, ns, ms, rows, C, n, m = kept
    want = kept_shapes(q, v, chunk_size)
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
    through the stabilizer max: what gates_from_row_sums and
    ops/mlstm/reference_backward.route_max_grads compute in torch (the tests' oracle)."""
    from ..limits import next_power_of_2

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
    the row sums rs [B*H, tiles, 2, S] (mlstm_bwd_ds says why). Exact: with the stabilizers fixed,
    every weight depends on the gates through b_t - b_s + i_s alone. Summed per chunk, with the
    rows after a chunk entering as <C, dC> at its end (taken by the reverse scan), bf16 state
    rounding does not accumulate along the row as a whole-row cumsum's does. What mlstm_bwd_route
    computes before routing the eps term: the tests' oracle for it."""
    import torch.nn.functional as F

    NC = -(-S // L)
    r = rs.view(B, H, -1, 2, S).sum(2)
    d = F.pad(r[:, :, 0] - r[:, :, 1], (0, NC * L - S)).view(B, H, NC, L)
    ends = cdc.view(B, H, NC).clone()
    ends[..., -1] = -dmT.sum(-1).view(B, H)
    return r[:, :, 1], (d.flip(-1).cumsum(-1).flip(-1) + ends[..., None]).view(B, H, NC * L)[..., :S]


def _backward(cfg, dh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, h, kept=None):
    B, H, S = q.shape[:3]
    dims = _head(q, v)
    DKR, DVR = dims["DKR"], dims["DVR"]
    scale, masks = DKR ** -0.5, _masks(dims)
    dev, f32 = q.device, torch.float32
    L, BK, BVS, warps, stages = cfg["L"], cfg["BK"], cfg["BVS"], cfg["warps"], cfg["stages"]
    NC = -(-S // L)
    grid = _state_grid(B * H, dims, BK, BVS)
    NT = _state_tiles(dims, BK, BVS)
    rows = None
    if kept is not None and kept[0] == L:  # the forward's states and row terms: no second scan, no q k^T
        (Cs, ns, ms), rows, (CT, nT, mT) = kept[1:]
    else:
        (Cs, ns, ms), (CT, nT, mT) = chunk_states(k, v, i, f, C0, n0, m0, cfg)
    N, dden, dm = (torch.empty(B, H, S, device=dev, dtype=f32) for _ in range(3))
    # the scan's row factors r/N, r dden [B, H, S] and each chunk's log forget product g [B*H*NC]
    factors = [torch.empty(n, device=dev, dtype=f32) for n in (B * H * S, B * H * S, B * H * NC)]
    saved = (rows,) if rows is not None else ()
    _launch(_kernel("mlstm_bwd_rows.py.jinja", q.dtype, saved_rows=bool(saved), **masks),
        (B * H, NC), q, k, i, f, h, dh, ns, ms, *saved, N, dden, dm, *factors, *_rows(q, k, i, f, h, dh),
        S, NC, scale, eps, **dims, BV=cfg["BV"], L=L, num_warps=warps, num_stages=stages)
    dCs, dns = _state_buffer(Cs.shape, Cs.dtype, dev), _state_buffer(ns.shape, ns.dtype, dev)
    dC0, dn0 = _state_buffer(CT.shape, f32, dev), _state_buffer(nT.shape, f32, dev)
    DVS = cfg.get("DVS")  # split variant: dv in its own kernel, one program per DV tile
    DKS = cfg.get("DKS")  # and dq, dk in theirs, one program per DK tile (without DVS: dv stays in mlstm_bwd_ds)
    dmT = torch.empty(B * H, NT, device=dev, dtype=f32)
    dg = torch.empty(B * H, NC, NT, device=dev, dtype=f32)  # per (chunk, scan tile) parts of <C, dC> at the chunk's end
    final = (gC, gn, CT, nT) if gC is not None else ()
    _launch(_kernel("mlstm_bwd_states.py.jinja", q.dtype, final_grads=bool(final), **masks),
        grid, q, dh, Cs, ns, ms, *final, mT, dCs, dns, dg, dmT, dC0, dn0,
        *factors, *_rows(q, dh), S, NC, NT, **dims, BK=BK, BV=BVS, L=L, num_warps=configs.scan_warps(cfg),
        num_stages=stages)
    # the stabilizer of the state leaving each chunk, which scales its gradient in dCs, dns
    me = torch.cat((ms.view(B * H, NC)[:, 1:], mT.reshape(B * H, 1).float()), 1).contiguous()
    # in the layout the op's fake promises (ops/mlstm/op.gradient_strides: a dense transposed view's own)
    dq, dk, dv = (gradient_like(t) for t in (q, k, v))
    dg = dg.sum(-1)  # <C, dC> at each chunk's end
    # the gates' gradients from q.dq and k.dk per row and DK tile (gates_from_row_sums says why)
    rs = torch.empty(B * H * (_tiles(DKR, DKS) if DKS else 1) * 2 * S, device=dev, dtype=f32)
    if DVS:
        _launch(_kernel("mlstm_bwd_dv.py.jinja", q.dtype, **masks), (B * H * NC * _tiles(DVR, DVS),),
            q, k, v, i, f, dh, ms, me, dCs, N, dv,
            *_rows(q, k, v, i, f, dh, dv), S, NC, scale, **dims, BV=DVS, L=L, num_warps=warps,
            num_stages=stages)
    if DKS:  # dS scratch: L/DK of q's size (128 MiB at B8 NH16 S8192 128/128)
        dS = torch.empty(B * H * NC * L * L, device=dev, dtype=q.dtype)
        wu = torch.empty(B * H * NC * 2 * L, device=dev, dtype=f32)
        _launch(_kernel("mlstm_bwd_ds.py.jinja", q.dtype, split_dv=bool(DVS), **masks), (B * H, NC),
            q, k, v, i, f, dh, ms, me, dCs, N, dden, dS, wu, dv, *_rows(q, k, v, i, f, dh, *(() if DVS else (dv,))),
            S, NC, scale, **dims, BV=cfg["BV"], L=L, num_warps=warps, num_stages=stages)
        _launch(_kernel("mlstm_bwd_dqdk.py.jinja", q.dtype, **masks), (B * H * NC * _tiles(DKR, DKS),),
            q, k, v, dh, Cs, ns, dCs, dns, N, dden, dS, wu, dq, dk, rs,
            *_rows(q, k, v, dh, dq, dk), S, NC, scale,
            **dims, BK=DKS, BV=cfg["BV"], L=L, num_warps=warps, num_stages=stages)
    else:
        _launch(_kernel("mlstm_bwd.py.jinja", q.dtype, split_dv=bool(DVS), **masks), (B * H, NC),
            q, k, v, i, f, dh, Cs, ns, ms, me, dCs, dns, N, dden, dq, dk, dv, rs,
            *_rows(q, k, v, i, f, dh, dq, dk, *(() if DVS else (dv,))), S, NC, scale,
            **dims, BV=cfg["BV"], L=L, num_warps=warps, num_stages=stages)
    di_out, df_out, r_dm0 = route_max_grad(dm, gm, dmT, i, f, rs, dg, L, m0.float() if C0 is not None else None)
    grads = [dq, dk, dv, di_out, df_out]
    if C0 is not None:  # dC0, dn0: stabilized by m0, as C0 and n0 are (cut where the head is padded:
        # the tiles past the true dims are unwritten)
        dC0, dn0, C0, n0 = dC0[..., :DKR, :DVR], dn0[..., :DKR], C0[..., :DKR, :DVR], n0[..., :DKR]
        dm0 = (dC0 * C0.float()).sum((-1, -2)) + (dn0 * n0.float()).sum(-1) + r_dm0
        grads += [dC0.to(C0.dtype), dn0.to(n0.dtype), dm0.to(m0.dtype)]
    else:
        grads += [None, None, None]
    return grads
