"""Generated Triton kernels for xaccel::headwise and xaccel::headwise_weight_grad, rendered per
op from templates/; the block sizes are compile-time constants.

A per-head map with blocks of a few elements (the xlstm package's q, k, v projections use 4 x 4)
is no GEMM: cuBLAS runs it as a batched GEMM of 4-wide tiles after permuting x into [H, M, D],
both far from memory speed. These kernels read x in place and write y once."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from triton import cdiv, next_power_of_2

from .. import cache
from ..limits import INT32_LIMIT
from ..render import Templates
from ..triton_launch import LaunchCache

TEMPLATES = Templates(Path(__file__).parent / "templates")
MAX_BLOCK = 16  # D and DO up to this; larger blocks are GEMMs that cuBLAS runs well
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE = 16384  # elements of a forward program's [BM, BH, DO, D] product (64 fp32 registers per thread at 8 warps)
WGRAD_TILE = 8192  # the weight gradient's [BM, BH, DO, D] accumulator, beside its loads
BH = 32  # heads per program: at 4 x 4 blocks, 128 contiguous elements of each x row
ROWS = 256  # rows each weight-gradient program sums
_KERNELS: dict = {}
_LAUNCHES = LaunchCache()  # a projection runs at a few shapes per model: from its second call, directly


def _kernel(template: str):
    if template not in _KERNELS:
        name = template.split(".")[0] + "_" + hashlib.sha256(f"{template}|{TEMPLATES.digest}".encode()).hexdigest()[:12]
        source = TEMPLATES.render(template, kernel_name=name)
        _KERNELS[template] = getattr(cache.load_source(name, source), name)
    return _KERNELS[template]


def why_not(x, w) -> str | None:
    """Why the kernels would not run this case (None: they would), on tensors or fake values."""
    if w.dtype != x.dtype:
        return f"no headwise kernel for {x.dtype} x {w.dtype}"
    return _uncovered(x, *w.shape)


def _uncovered(x, H: int, DO: int, D: int) -> str | None:
    if x.dtype not in DTYPES:
        return f"no headwise kernel for {x.dtype}"
    if D > MAX_BLOCK or DO > MAX_BLOCK:
        return f"blocks of {D} x {DO} (the kernel takes up to {MAX_BLOCK} x {MAX_BLOCK}; larger ones are GEMMs)"
    if x.dim() < 2 or tuple(x.shape[-2:]) != (H, D):
        return f"x {tuple(x.shape)} does not end in the weight's [{H}, {D}]"
    if x.numel() // D * max(D, DO) >= INT32_LIMIT:
        return "more than 2^31 elements"
    return None


def _rows_of(t, H: int, last: int):
    """t as [M, H, last], a view where its layout allows (else a copy)."""
    return t.reshape(-1, H, last)


def _tiles(D: int, DO: int, budget: int) -> tuple[int, int, int]:
    """(DP, OP, BM): D and DO rounded up to powers of two, and the rows per program that fill budget."""
    DP, OP = next_power_of_2(D), next_power_of_2(DO)
    return DP, OP, max(1, min(64, budget // (BH * DP * OP)))


def forward(key, x, w):
    """Kernel path for xaccel::headwise, or NotImplemented."""
    if why_not(x, w) is not None:
        return NotImplemented
    H, DO, D = w.shape
    x3 = _rows_of(x, H, D)
    M = x3.shape[0]
    y = torch.empty(M, H, DO, dtype=x.dtype, device=x.device)
    if M:
        DP, OP, BM = _tiles(D, DO, TILE)
        ints = (M, H, *x3.stride(), *w.stride())
        meta = dict(DO=DO, D=D, OP=OP, DP=DP, BM=BM, BH=BH, num_warps=8 if BM * BH * DP * OP >= TILE else 4)
        _LAUNCHES.launch(("fwd", x.device, x.dtype, ints, DO, D), _kernel("headwise.py.jinja"),
                         (cdiv(M, BM), cdiv(H, BH)), (x3, w, y, *ints), meta, (x3, w, y))
    return y.view(*x.shape[:-1], DO)


def weight_grad(key, dy, x):
    """Kernel path for xaccel::headwise_weight_grad, or NotImplemented."""
    if dy.dtype != x.dtype or dy.shape[:-1] != x.shape[:-1]:
        return NotImplemented
    H, D, DO = x.shape[-2], x.shape[-1], dy.shape[-1]
    if _uncovered(x, H, DO, D) is not None:
        return NotImplemented
    x3, dy3 = _rows_of(x, H, D), _rows_of(dy, H, DO)
    M = x3.shape[0]
    if not M:
        return torch.zeros(H, DO, D, dtype=torch.float32, device=x.device)
    DP, OP, BM = _tiles(D, DO, WGRAD_TILE)
    BM, chunks = min(BM, ROWS), cdiv(M, ROWS)
    parts = torch.empty(chunks, H, DO, D, dtype=torch.float32, device=x.device)  # every program writes its own
    ints = (M, H, *dy3.stride(), *x3.stride())
    meta = dict(DO=DO, D=D, OP=OP, DP=DP, ROWS=ROWS, BM=BM, BH=BH, num_warps=8)
    _LAUNCHES.launch(("wgrad", x.device, x.dtype, ints, DO, D), _kernel("headwise_weight_grad.py.jinja"),
                     (chunks, cdiv(H, BH)), (dy3, x3, parts, *ints), meta, (dy3, x3, parts))
    return parts.sum(0)
