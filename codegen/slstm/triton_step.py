"""The decode step of xaccel::slstm_step as one generated Triton kernel (templates/slstm_step.py.jinja),
rendered per variant (fresh rule, clamped gates, clamped n) and dtypes: one launch per step, no
host synchronisation (the batch fresh rule is decided on the device), outputs from torch.empty,
so a CUDA graph can capture it. Tile configurations are tuned once per shape class; under Triton's
interpreter a fixed one runs."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from torch_xaccel import runtime
from torch_xaccel.runtime import interpreting

from .. import cache, precision as fp32_dots, tuning
from ..limits import INT32_LIMIT, SHARED_LIMIT, next_power_of_2, reach
from ..render import Templates
from ..triton_launch import LaunchCache

TEMPLATES = Templates(Path(__file__).parent / "templates")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCAN = 1024  # n entries per iteration of the batch fresh rule's scan
# under the interpreter (no timing): tiles that keep its per-program NumPy work short
INTERPRETER_CONFIG = {"BB": 16, "BJ": 32, "BK": 64, "warps": 4, "stages": 1}
_KERNELS: dict = {}


def _tl(dtype: torch.dtype) -> str:
    return "tl." + str(dtype).removeprefix("torch.")


def render(fresh: str, clamp_gates: bool, clamp_n: bool, wx_dtype: torch.dtype, dot_dtype: torch.dtype,
           precision: str | None = None) -> tuple[str, str]:
    """(kernel name, source) of the step for one variant. fp32 dots run at the precision torch's
    float32 matmul setting allows (codegen/precision.py; `precision` overrides it): at
    "highest" 3xTF32, which matches the reference to about fp32 rounding, at "high" TF32. The
    precision is part of the name (16-bit dots: none, the names as before)."""
    values = dict(fresh=fresh, clamp_gates=clamp_gates, clamp_n=clamp_n, wx_dtype=str(wx_dtype),
                  dot_dtype=str(dot_dtype))
    if dot_dtype == torch.float32:
        values["precision"] = precision or fp32_dots.dot_precision(dot_dtype)
    tag = hashlib.sha256(repr(sorted(values.items())).encode() + TEMPLATES.digest.encode()).hexdigest()[:12]
    name = f"slstm_step_{tag}"
    dots = f', input_precision="{values["precision"]}"' if dot_dtype == torch.float32 else ""
    src = TEMPLATES.render("slstm_step.py.jinja", kernel_name=name, wx=_tl(wx_dtype), dot=_tl(dot_dtype),
                           **dict(values, precision=dots))
    return name, src


def _kernel(fresh: str, clamp_gates: bool, clamp_n: bool, wx_dtype: torch.dtype, dot_dtype: torch.dtype):
    precision = fp32_dots.dot_precision(dot_dtype)
    key = (fresh, clamp_gates, clamp_n, wx_dtype, dot_dtype, precision, interpreting())
    kernel = _KERNELS.get(key)
    if kernel is None:
        name, src = render(fresh, clamp_gates, clamp_n, wx_dtype, dot_dtype, precision)
        kernel = _KERNELS[key] = getattr(cache.load_source(name, src), name)
    return kernel


def dot_dtype(Wx: torch.Tensor, R: torch.Tensor) -> torch.dtype:
    """The product's input dtype: Wx's when R has it (16-bit products are exact in the fp32
    accumulator), else fp32, where both convert exactly or as the reference converts them."""
    return Wx.dtype if R.dtype == Wx.dtype else torch.float32


def _chunk(D: int) -> int:
    return min(64, max(16, next_power_of_2(D)))


def candidates(B: int, D: int, size: int = 2) -> list[dict]:
    """The configurations tried for B rows and head dim D (dot operands of `size` bytes): batch
    tiles of 16 rows (the most programs over the same R tiles) up to all rows in one tile (R read
    fewer times), 16 or 32 units per program, K chunks of 64 (or 128 where D is a multiple of
    it), 2 or 4 warps; those whose pipelined R and h tiles fit shared memory."""
    tiles = [bb for bb in (16, 32, 64) if bb == 16 or bb <= next_power_of_2(B)]
    chunks = [64, 128] if D % 128 == 0 else [_chunk(D)]
    units = [bj for bj in (16, 32) if bj == 16 or bj <= next_power_of_2(D)]
    return [{"BB": bb, "BJ": bj, "BK": bk, "warps": w, "stages": 3}
            for bb in tiles for bj in units for bk in chunks for w in (2, 4)
            if not (w == 2 and bb * bj > 512) and 3 * (4 * bj + bb) * bk * size <= SHARED_LIMIT]


def default(B: int, D: int) -> dict:
    """The untimed choice: 16-row batch tiles and 32 units per program, K chunks of 64; it fits
    shared memory for every operand size."""
    return {"BB": 16, "BJ": 32, "BK": _chunk(D), "warps": 4, "stages": 3}


def launch(cfg: dict, Wx, R, b, h, c, n, m, fresh, clamp_gates, clamp_n, warmup: bool = False):
    """(h', c', n', m') fp32 [B, NH, D] from one launch of the step in configuration cfg. R, b and
    the states dense; Wx with any strides."""
    B, _, NH, D = Wx.shape
    outs = [torch.empty(B, NH, D, dtype=torch.float32, device=Wx.device) for _ in range(4)]
    kernel = _kernel(fresh, bool(clamp_gates), bool(clamp_n), Wx.dtype, dot_dtype(Wx, R))
    grid = (-(-B // cfg["BB"]), NH, -(-D // cfg["BJ"]))
    args = (Wx, R, b, h, c, n, m, *outs, B, *Wx.stride())
    meta = dict(NH=NH, D=D, BB=cfg["BB"], BJ=cfg["BJ"], BK=cfg["BK"], SCAN=SCAN)
    launch_meta = dict(meta, num_warps=cfg["warps"], num_stages=cfg["stages"])
    if warmup:
        kernel.run(*args, grid=grid, warmup=True, **launch_meta)
        return outs
    # a decode step is host-bound: from the second call of a shape, its compiled kernel directly
    shape = (kernel, Wx.device, B, NH, D, Wx.stride(), tuple(sorted(cfg.items())),
             tuple(t.dtype for t in (R, b, h, c, n, m)))
    _LAUNCHES.launch(shape, kernel, grid, args, launch_meta, args[:11])
    return outs


_LAUNCHES = LaunchCache()  # keyed by (kernel, device, shapes, strides, config, dtypes)


def _why_not(Wx, R, b, states) -> str | None:
    """None when the kernel covers the case, else why not."""
    B, _, NH, D = Wx.shape
    if Wx.dtype not in DTYPES or R.dtype not in DTYPES:
        return f"Wx {Wx.dtype}, R {R.dtype} (the kernel takes fp32, fp16 and bf16; fp64 runs the reference)"
    if not all(s.dtype.is_floating_point for s in (b, *states)):
        return "a non-floating bias or state"
    if interpreting() and torch.bfloat16 in (Wx.dtype, R.dtype, b.dtype, *(s.dtype for s in states)):
        return "bf16 under Triton's interpreter (its bf16 arithmetic is not torch's)"
    if B == 0 or NH == 0 or D == 0:
        return "an empty batch or head"
    if any(tuple(s.shape) != (B, NH, D) for s in states):
        return "a state that is not [B, NH, D]"
    if any(t.device != Wx.device for t in (R, b, *states)):
        return "tensors on different devices"
    if R.numel() >= INT32_LIMIT or B * NH * D >= INT32_LIMIT:
        return "more than 2^31 elements (the kernel's offsets are int32)"
    return None


_CHOSEN: dict = {}  # (case key, dtypes, device, shape) -> config, for this process
_DECISIONS: dict = {}  # tuning key -> decision, for this process


def _config(key, Wx, R, run) -> dict:
    """The configuration for this case: the fixed one under the interpreter, else the tuned one
    (remembered per case key, so a decode step pays one dict lookup)."""
    B, _, NH, D = Wx.shape
    dots = dot_dtype(Wx, R)
    # fp32 dots: their precision too (a decision at TF32 does not hold at 3xTF32; 16-bit keys unchanged)
    precision = f"|{fp32_dots.dot_precision(dots)}" if dots == torch.float32 else ""
    memo = (key, Wx.dtype, R.dtype, Wx.device, B, NH, D, precision)
    cfg = _CHOSEN.get(memo)
    if cfg is not None:
        return cfg
    if interpreting() or Wx.device.type != "cuda":
        cfg = INTERPRETER_CONFIG
    else:
        cands, untimed = candidates(B, D, dots.itemsize), default(B, D)
        parts = f"step|{Wx.dtype}|R{R.dtype}{precision}|NH{NH}|D{D}|B~{next_power_of_2(B)}"
        tkey = tuning.key("slstm", parts, Wx.device, TEMPLATES.digest)

        def tune():
            timings: list = []
            return {"config": _fastest(f"slstm step NH{NH} D{D} B{B}", untimed, cands, run, timings),
                    "timings": timings}

        def valid(entry):
            return isinstance(entry, dict) and entry.get("config") in cands

        cfg = tuning.decide(tkey, untimed=untimed, valid=valid, tune=tune, memo=_DECISIONS).config
        if tuning.capturing():
            return cfg  # a captured call runs a stored or the untimed choice; a later one tunes
    _CHOSEN[memo] = cfg
    runtime.record_choice(key, "slstm_step", f"B{B} NH{NH} D{D} {Wx.dtype}",
                          f"triton BB{cfg['BB']} BJ{cfg['BJ']} BK{cfg['BK']} warps{cfg['warps']}")
    return cfg


def _fastest(label: str, untimed: dict, cands: list[dict], run, timings: list) -> dict:
    """The fastest candidate by GPU time of back-to-back steps (R stays in L2, as in decoding); a
    candidate counts only where its outputs agree with the untimed configuration's to 1e-3
    (the two differ in summation order only), so a miscompiled tile never wins. The untimed
    configuration serves when none is faster or none agrees."""
    tuning.precompile(cands, lambda cfg: run(cfg, warmup=True))
    want = [torch.nan_to_num(t) for t in run(untimed)]

    def bench(cfg):
        got = [torch.nan_to_num(t) for t in run(cfg)]
        if not all((g - w).norm() <= 1e-3 * w.norm() for g, w in zip(got, want)):
            raise ValueError("result differs from the untimed configuration's")
        return tuning.gpu_ms(lambda: run(cfg), calls=20, rounds=3)
    return tuning.fastest(label, cands, bench, best=untimed, timings=timings)


def step(key, Wx_t, R, b, h, c, n, m, fresh, clamp_gates, clamp_n):
    """Kernel path for xaccel::slstm_step: (h', c', n', m') fp32 [B, NH, D], or NotImplemented
    where the kernel does not apply (fp64 and the other cases _why_not names run the reference)."""
    states = (h, c, n, m)
    if _why_not(Wx_t, R, b, states) is not None:
        return NotImplemented
    if reach(Wx_t) > INT32_LIMIT:
        Wx_t = Wx_t.contiguous()  # int32 offsets: a slice far into a long sequence is copied
    R, b = R.contiguous(), b.contiguous()
    h, c, n, m = (s.contiguous() for s in states)

    def run(cfg, warmup=False):
        return launch(cfg, Wx_t, R, b, h, c, n, m, fresh, clamp_gates, clamp_n, warmup=warmup)

    return tuple(run(_config(key, Wx_t, R, run)))


def why_not(Wx_t, R, b, h, c, n, m) -> str | None:
    """For reports: why the step kernel does not take this case (None: it does)."""
    if not runtime.kernels_can_run(Wx_t):
        return "not a CUDA tensor"
    return _why_not(Wx_t, R, b, (h, c, n, m))
