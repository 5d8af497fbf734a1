"""Generated Triton kernels for xaccel::group_norm and its backward, rendered from templates/; the
group width and tiles are compile-time constants.

Memory-bound: the forward reads x once and writes y once; the backward reads x and dy once,
writes dx once and leaves the weight and bias gradients as per-chunk partial sums. ATen runs a
[N, C] group norm as separate moment, normalization and (in the backward) three reduction kernels."""
from __future__ import annotations

from pathlib import Path

import torch

from torch_xaccel.ops.group_norm import reference

from .. import cache, tuning
from ..limits import INT32_LIMIT, cdiv, next_power_of_2
from ..render import Templates
from ..triton_launch import LaunchCache

TEMPLATES = Templates(Path(__file__).parent / "templates")
MAX_GROUP = 8192  # channels per group up to this (a row tile of one group stays in registers)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE = 4096  # elements of a program's [BN, BG] tile
ROWS = 64  # rows each backward program sums into its partials
WARPS = 4
_LAUNCHES = LaunchCache()
_PLAIN = tuning.PlainCalls("group_norm", "group_norm", TEMPLATES.digest)  # a decode step's plain calls


def why_not(x, weight, bias, groups: int) -> str | None:
    """Why the kernels would not run this case (None: they would), on tensors or fake values."""
    if x.dtype not in DTYPES or any(t is not None and t.dtype != x.dtype for t in (weight, bias)):
        return f"no group_norm kernel for {x.dtype} with parameters in another dtype" if x.dtype in DTYPES \
            else f"no group_norm kernel for {x.dtype}"
    if x.dim() != 2 or groups < 1 or x.shape[1] % groups:
        return f"x {tuple(x.shape)} is not [N, C] with C a multiple of {groups} groups"
    if x.shape[1] // groups > MAX_GROUP:
        return f"groups of {x.shape[1] // groups} channels (the kernel takes up to {MAX_GROUP})"
    if x.numel() >= INT32_LIMIT:
        return "2^31 elements or more"
    return None


def _tiles(C: int, groups: int) -> tuple[int, int, int]:
    """(CG, BG, BN): channels per group, that rounded up to a power of two, rows per tile."""
    CG = C // groups
    BG = next_power_of_2(CG)
    return CG, BG, max(1, TILE // BG)


def forward(key, x, weight, bias, groups, eps):
    """Kernel path for xaccel::group_norm, or NotImplemented (also where a plain call of a small
    case costs less through the reference: tuning.PlainCalls)."""
    if why_not(x, weight, bias, groups) is not None:
        return NotImplemented
    if _PLAIN.reference_runs(key, x.numel(), x.device, lambda: f"{x.dtype}|x{tuple(x.shape)}|G{groups}",
                             lambda: kernel_forward(x, weight, bias, groups, eps),
                             lambda: reference.forward(x, weight, bias, groups, eps)):
        return NotImplemented
    return kernel_forward(x, weight, bias, groups, eps)


def kernel_forward(x, weight, bias, groups, eps):
    """The kernel, whichever path a plain call would take (the GPU tests call it)."""
    N, C = x.shape
    y = torch.empty(N, C, dtype=x.dtype, device=x.device)
    if y.numel():
        CG, BG, BN = _tiles(C, groups)
        ints = (N, C, *x.stride())
        meta = dict(CG=CG, BG=BG, BN=BN, HAS_W=weight is not None, HAS_B=bias is not None, num_warps=WARPS)
        tensors = (x, x if weight is None else weight, x if bias is None else bias, y)  # (absent: unread pointers)
        _LAUNCHES.launch(("fwd", x.device, x.dtype, ints, groups, weight is not None, bias is not None),
                         cache.template_kernel(TEMPLATES, "group_norm.py.jinja"), (cdiv(N, BN), groups),
                         (*tensors, *ints, float(eps)), meta, tensors)
    return y


def backward(key, dy, x, weight, groups, eps, with_bias):
    """Kernel path for xaccel::group_norm_backward, or NotImplemented."""
    if why_not(x, weight, None, groups) is not None or dy.dtype != x.dtype or dy.shape != x.shape:
        return NotImplemented
    N, C = x.shape
    dx = torch.empty(N, C, dtype=x.dtype, device=x.device)
    if not dx.numel():
        sums = torch.zeros(2, C, dtype=torch.float32, device=x.device)
    else:
        CG, BG, BN = _tiles(C, groups)
        chunks = cdiv(N, ROWS)
        parts = torch.empty(chunks, 2, C, dtype=torch.float32, device=x.device)  # each program its own
        ints = (N, C, *dy.stride(), *x.stride())
        meta = dict(CG=CG, BG=BG, BN=min(BN, ROWS), ROWS=ROWS, HAS_W=weight is not None, num_warps=WARPS)
        tensors = (dy, x, x if weight is None else weight, dx, parts)
        _LAUNCHES.launch(("bwd", x.device, x.dtype, ints, groups, weight is not None),
                         cache.template_kernel(TEMPLATES, "group_norm_backward.py.jinja"), (chunks, groups),
                         (*tensors, *ints, float(eps)), meta, tensors)
        sums = parts.sum(0)
    return dx, sums[0] if weight is not None else None, sums[1] if with_bias else None
