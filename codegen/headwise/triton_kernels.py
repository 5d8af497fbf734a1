"""Generated Triton kernels for xaccel::headwise and xaccel::headwise_weight_grad, rendered per
op from templates/; the block sizes are compile-time constants.

A per-head map with blocks of a few elements (the xlstm package's q, k, v projections use 4 x 4)
is no GEMM: cuBLAS runs it as a batched GEMM of 4-wide tiles after permuting x into [H, M, D],
both far from memory speed. These kernels read x in place and write y once: a program takes a
group of heads whose blocks form one block-diagonal matrix and runs it as a tensor-core dot."""
from __future__ import annotations

from pathlib import Path

import torch

from torch_xaccel.ops.headwise import reference

from .. import cache, tuning
from ..limits import INT32_LIMIT, cdiv, next_power_of_2
from ..render import Templates
from ..triton_launch import LaunchCache

TEMPLATES = Templates(Path(__file__).parent / "templates")
MAX_BLOCK = 16  # D and DO up to this; larger blocks are GEMMs that cuBLAS runs well
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_DIAGONAL = 64  # a program's block-diagonal matrix spans up to this many x and y columns
BM, WARPS = 64, 4  # a forward program's rows
WGRAD_BM, ROWS, WGRAD_WARPS = 64, 256, 4  # the weight gradient's row tile; rows each program sums
_LAUNCHES = LaunchCache()  # a projection runs at a few shapes per model: from its second call, directly
_PLAIN = tuning.PlainCalls("headwise", "headwise", TEMPLATES.digest)  # a decode step's plain calls


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 (TF32 would round x and w to 10 mantissa bits)."""
    return "ieee" if dtype == torch.float32 else "tf32"


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


def _merged_stride(sizes, strides) -> int | None:
    """The stride of dims merged into one (a view), or None where their layout does not allow it."""
    dims = [(n, st) for n, st in zip(sizes, strides) if n != 1]
    if any(outer != inner * n for (_, outer), (n, inner) in zip(dims, dims[1:])):
        return None
    return dims[-1][1] if dims else 1


def _rows_of(t, H: int, last: int):
    """t [..., H, last] as [B1, S1, H, last], a view where its layout allows (else a copy): one
    batch of rows when the leading dims merge, else the innermost leading dim as S1 and the others
    as B1 (a transposed activation, [B, S, H, D] with S innermost, is read in place). Decided from
    the strides, not by trying views: a failed view raises, and that costs host time per call."""
    if not t.numel():
        return t.reshape(1, -1, H, last)
    lead, strides = t.shape[:-2], t.stride()[:-2]
    M = t.numel() // (H * last)
    inner = t.stride()[-2:]
    one = _merged_stride(lead, strides)
    if one is not None:
        return t.as_strided((1, M, H, last), (M * one, one, *inner))
    outer = _merged_stride(lead[:-1], strides[:-1])
    if outer is not None:
        return t.as_strided((M // lead[-1], lead[-1], H, last), (outer, strides[-1], *inner))
    return t.reshape(1, -1, H, last)


def _same_rows(x, dy, H: int, D: int, DO: int):
    """x and dy as [B1, S1, H, *] with the same row split: each its own where they agree, else the
    other's split for whichever is contiguous (it takes any), else both as one batch of rows."""
    x4, dy4 = _rows_of(x, H, D), _rows_of(dy, H, DO)
    if x4.shape[:2] == dy4.shape[:2]:
        return x4, dy4
    if dy.is_contiguous():
        return x4, dy.view(*x4.shape[:2], H, DO)
    if x.is_contiguous():
        return x.view(*dy4.shape[:2], H, D), dy4
    return x.reshape(1, -1, H, D), dy.reshape(1, -1, H, DO)


def _tiles(D: int, DO: int) -> tuple[int, int, int]:
    """(G, BK, BN): heads per program and its block-diagonal matrix's dims (tl.dot needs >= 16)."""
    G = max(1, BLOCK_DIAGONAL // max(D, DO))
    return G, max(16, next_power_of_2(G * D)), max(16, next_power_of_2(G * DO))


def forward(key, x, w, addend=None):
    """Kernel path for xaccel::headwise, or NotImplemented (also where a plain call of a small
    case costs less through the reference: tuning.PlainCalls)."""
    if why_not(x, w) is not None or _addend_unfit(x, w, addend):
        return NotImplemented
    if _PLAIN.reference_runs(key, x.numel(), x.device, lambda: f"{x.dtype}|x{tuple(x.shape)}|w{tuple(w.shape)}",
                             lambda: kernel_forward(x, w, addend), lambda: reference.forward(x, w, addend)):
        return NotImplemented
    return kernel_forward(x, w, addend)


def _addend_unfit(x, w, addend) -> bool:
    """An addend the kernel does not take (the reference does): not y's shape or dtype."""
    return addend is not None and (addend.dtype != x.dtype or addend.shape != (*x.shape[:-1], w.shape[1]))


def _addend_rows(addend, B1: int, S1: int, H: int, DO: int):
    """The addend as [B1, S1, H, DO], the row split of x: a view where its layout allows."""
    a4 = _rows_of(addend, H, DO)
    return a4 if a4.shape[:2] == (B1, S1) else addend.reshape(B1, S1, H, DO)


def kernel_forward(x, w, addend=None):
    """The kernel, whichever path a plain call would take (the GPU tests call it)."""
    H, DO, D = w.shape
    x4 = _rows_of(x, H, D)
    B1, S1 = x4.shape[:2]
    y = torch.empty(*x.shape[:-1], DO, dtype=x.dtype, device=x.device)
    if y.numel():
        G, BK, BN = _tiles(D, DO)
        tiles = cdiv(S1, BM)
        flat = x4.stride(3) == 1 and x4.stride(2) == D
        a4 = y if addend is None else _addend_rows(addend, B1, S1, H, DO)  # (no addend: an unread pointer)
        ints = (H, S1, tiles, *x4.stride(), *w.stride(), *(a4.stride() if addend is not None else (0,) * 4))
        meta = dict(DO=DO, D=D, G=G, BM=BM, BK=BK, BN=BN, X_FLAT=flat, ADD=addend is not None, num_warps=WARPS)
        kernel = cache.template_kernel(TEMPLATES, "headwise.py.jinja", precision=_precision(x.dtype))
        _LAUNCHES.launch(("fwd", x.device, x.dtype, ints, DO, D, addend is not None), kernel,
                         (B1 * tiles, cdiv(H, G)), (x4, w, y, a4, *ints), meta, (x4, w, y, a4))
    return y


def weight_grad(key, dy, x):
    """Kernel path for xaccel::headwise_weight_grad, or NotImplemented."""
    if dy.dtype != x.dtype or dy.shape[:-1] != x.shape[:-1]:
        return NotImplemented
    H, D, DO = x.shape[-2], x.shape[-1], dy.shape[-1]
    if _uncovered(x, H, DO, D) is not None:
        return NotImplemented
    x4, dy4 = _same_rows(x, dy, H, D, DO)
    B1, S1 = x4.shape[:2]
    if not x4.numel():
        return torch.zeros(H, DO, D, dtype=torch.float32, device=x.device)
    G, BK, BN = _tiles(D, DO)
    chunks = cdiv(S1, ROWS)
    parts = torch.empty(B1 * chunks, H, DO, D, dtype=torch.float32, device=x.device)  # every program writes its own
    ints = (H, S1, chunks, *dy4.stride(), *x4.stride())
    meta = dict(DO=DO, D=D, G=G, ROWS=ROWS, BM=WGRAD_BM, BK=BK, BN=BN, X_POSITIONS_INNER=x4.stride(1) == 1 and S1 > 1,
                num_warps=WGRAD_WARPS)
    kernel = cache.template_kernel(TEMPLATES, "headwise_weight_grad.py.jinja", precision=_precision(x.dtype))
    _LAUNCHES.launch(("wgrad", x.device, x.dtype, ints, DO, D), kernel,
                     (B1 * chunks, cdiv(H, G)), (dy4, x4, parts, *ints), meta, (dy4, x4, parts))
    return parts.sum(0)
