"""Generated Triton kernels for xaccel::skinny_linear and its backward, rendered from templates/;
the inputs' widths, the output count and the tiles are compile-time constants.

A linear with a handful of outputs is memory-bound: the forward reads each input once and writes
[M, N]; the backward reads dy and each input once, writes each input's gradient once and leaves
the weight gradient as per-chunk partial sums. cuBLAS runs such a GEMM with tiles made for wide
outputs, and the user's concatenation of the inputs costs a copy (and its gradient a second)."""
from __future__ import annotations

from pathlib import Path

import torch

from .. import cache
from ..limits import INT32_LIMIT, cdiv
from ..render import Templates
from ..triton_launch import LaunchCache

TEMPLATES = Templates(Path(__file__).parent / "templates")
MAX_N = 16  # outputs up to this (one tensor-core tile wide)
MAX_INPUTS = 4
MIN_ROWS = 1024  # on CUDA, fewer rows run the reference (cuBLAS): too few programs to fill the GPU
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NP = 16  # the outputs padded to the smallest tensor-core tile
BK = 64  # columns per tile
ROWS = 512  # rows each backward program sums into its partials
WARPS = 4
_LAUNCHES = LaunchCache()


def why_not(weight, bias, xs) -> str | None:
    """Why the kernels would not run this case (None: they would), on tensors or fake values."""
    dtype = xs[0].dtype
    if dtype not in DTYPES:
        return f"no skinny_linear kernel for {dtype}"
    if any(t is not None and t.dtype != dtype for t in (weight, bias, *xs)):
        return "inputs, weight and bias of different dtypes"
    if not 1 <= len(xs) <= MAX_INPUTS:
        return f"{len(xs)} inputs (the kernels take 1 to {MAX_INPUTS})"
    if weight.dim() != 2 or weight.shape[0] > MAX_N:
        return f"weight {tuple(weight.shape)}: more than {MAX_N} outputs"
    if any(x.shape[:-1] != xs[0].shape[:-1] for x in xs) or sum(x.shape[-1] for x in xs) != weight.shape[1]:
        return "inputs whose leading dims differ or whose widths do not sum to the weight's"
    if any(x.numel() >= INT32_LIMIT for x in xs):
        return "2^31 elements or more"
    return None


def _rows(x):
    """x as [M, K_j] rows (a view where its leading dims allow, else a copy)."""
    return x.reshape(-1, x.shape[-1])


def _layout(xs) -> dict:
    """The template's values (tuples: template_kernel keys on them)."""
    widths = tuple(x.shape[-1] for x in xs)
    offsets = tuple(sum(widths[:j]) for j in range(len(xs)))
    tiles = tuple(cdiv(w, BK) for w in widths)
    return dict(n_xs=len(xs), widths=widths, offsets=offsets, tiles=tiles,
                tile_ends=tuple(sum(tiles[:j + 1]) for j in range(len(xs))),
                precision="ieee" if xs[0].dtype == torch.float32 else "tf32")


def _too_few_rows(x, M: int) -> bool:
    return x.device.type == "cuda" and M < MIN_ROWS


def _row_tile(M: int) -> int:
    """Rows per forward program: fewer where that keeps several programs per SM busy."""
    return 64 if M >= 64 * 1024 else 32 if M >= 32 * 512 else 16


def forward(key, weight, bias, xs):
    """Kernel path for xaccel::skinny_linear, or NotImplemented."""
    if why_not(weight, bias, xs) is not None:
        return NotImplemented
    rows = [_rows(x) for x in xs]
    M, N = rows[0].shape[0], weight.shape[0]
    if _too_few_rows(xs[0], M):
        return NotImplemented
    y = torch.empty(*xs[0].shape[:-1], N, dtype=xs[0].dtype, device=xs[0].device)
    if y.numel():
        BM = _row_tile(M)
        layout = _layout(xs)
        strides = tuple(s for r in rows for s in r.stride())
        ints = (M, *weight.stride())
        meta = dict(N=N, NP=NP, BM=BM, BK=BK, HAS_B=bias is not None, num_warps=WARPS)
        tensors = (weight, weight if bias is None else bias, y, *rows)  # (absent bias: an unread pointer)
        args = (*tensors[:3], *ints, *(v for r in rows for v in (r, *r.stride())))
        _LAUNCHES.launch(("fwd", y.device, y.dtype, ints, strides, layout["widths"], N, bias is not None),
                         cache.template_kernel(TEMPLATES, "skinny_linear.py.jinja", **layout),
                         (cdiv(M, BM),), args, meta, tensors)
    return y


def backward(key, dy, weight, xs, with_bias, addends=None):
    """Kernel path for xaccel::skinny_linear_backward, or NotImplemented."""
    addends = addends or [None] * len(xs)
    if why_not(weight, None, xs) is not None or dy.dtype != xs[0].dtype or any(
            a is not None and (a.shape != x.shape or a.dtype != x.dtype) for a, x in zip(addends, xs)):
        return NotImplemented
    rows = [_rows(x) for x in xs]
    M, (N, K) = rows[0].shape[0], weight.shape
    if _too_few_rows(xs[0], M):
        return NotImplemented
    dy_rows = dy.reshape(M, N)
    dxs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    if M == 0:
        dweight = torch.zeros(N, K, dtype=torch.float32, device=dy.device)
    else:
        layout = _layout(xs)
        chunks = cdiv(M, ROWS)
        parts = torch.empty(chunks, N, K, dtype=torch.float32, device=dy.device)  # each program its own
        add_rows = [r if a is None else _rows(a) for a, r in zip(addends, rows)]  # (None: an unread pointer)
        strides = tuple(s for r in (*rows, *add_rows) for s in r.stride())
        ints = (M, *dy_rows.stride(), *weight.stride())
        adds = {f"ADD{j}": a is not None for j, a in enumerate(addends)}
        meta = dict(N=N, NP=NP, BM=32, BK=BK, ROWS=ROWS, num_warps=WARPS, **adds)
        tensors = (dy_rows, weight, parts, *rows, *dxs, *add_rows)
        args = (dy_rows, weight, parts, *ints,
                *(v for j, r in enumerate(rows) for v in (r, *r.stride(), dxs[j], add_rows[j], *add_rows[j].stride())))
        _LAUNCHES.launch(("bwd", dy.device, dy.dtype, ints, strides, layout["widths"], tuple(adds.values())),
                         cache.template_kernel(TEMPLATES, "skinny_linear_backward.py.jinja", **layout),
                         (chunks, layout["tile_ends"][-1]), args, meta, tensors)
        dweight = parts.sum(0)
    dbias = dy_rows.sum(0, dtype=torch.float32) if with_bias else dy.new_empty(0, dtype=torch.float32)
    return dxs + [dweight, dbias]
