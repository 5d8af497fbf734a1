"""Generated Triton kernels for xaccel::causal_conv1d and its backward, rendered from templates/;
the kernel size and tiles are compile-time constants.

A depthwise convolution of a few taps is memory-bound. ATen runs it as a generic depthwise 2-D
convolution on a [B, C, 1, S] copy of the input; these kernels read x in place through its
strides (the usual transposed [B, S, C] activation included) and write y once, channels innermost."""
from __future__ import annotations

from pathlib import Path

import torch

from torch_xaccel.ops.causal_conv.reference import channels_last_like

from .. import cache
from ..limits import INT32_LIMIT, cdiv
from ..render import Templates
from ..triton_launch import LaunchCache

TEMPLATES = Templates(Path(__file__).parent / "templates")
MAX_K = 16  # kernel sizes up to this (the short convolutions of xLSTM and Mamba-style layers take 2-4)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BS, BC, WARPS = 64, 64, 4  # a program's positions x channels
ROWS = 256  # positions each weight-gradient program sums
_LAUNCHES = LaunchCache()


def why_not(x, w, bias=None) -> str | None:
    """Why the kernels would not run this case (None: they would), on tensors or fake values."""
    if x.dtype not in DTYPES or w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"no causal_conv1d kernel for {x.dtype} x {w.dtype}" + (f" + {bias.dtype}" if bias is not None else "")
    if x.dim() != 3 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        return f"x {tuple(x.shape)} and w {tuple(w.shape)} are not [B, C, S] and [C, K]"
    if w.shape[1] > MAX_K:
        return f"kernel size {w.shape[1]} (the kernel takes up to {MAX_K})"
    if x.numel() >= INT32_LIMIT:
        return "2^31 elements or more"
    return None


def _convolve(x, w, bias, y, reverse: bool) -> None:
    B, C, S = x.shape
    if not y.numel():
        return
    tiles = cdiv(S, BS)
    ints = (C, S, tiles, *x.stride(), *w.stride(), *y.stride())
    meta = dict(K=w.shape[1], BS=BS, BC=BC, HAS_BIAS=bias is not None, REVERSE=reverse, num_warps=WARPS)
    tensors = (x, w, w if bias is None else bias, y)  # (no bias: an unread pointer)
    _LAUNCHES.launch(("conv", x.device, x.dtype, ints, w.shape[1], bias is not None, reverse),
                     cache.template_kernel(TEMPLATES, "causal_conv1d.py.jinja"), (B * tiles, cdiv(C, BC)),
                     (*tensors, *ints), meta, tensors)


def forward(key, x, w, bias):
    """Kernel path for xaccel::causal_conv1d, or NotImplemented."""
    if why_not(x, w, bias) is not None:
        return NotImplemented
    y = channels_last_like(x)
    _convolve(x, w, bias, y, reverse=False)
    return y


def backward(key, dy, x, w, with_bias):
    """Kernel path for xaccel::causal_conv1d_backward, or NotImplemented."""
    if why_not(x, w) is not None or dy.dtype != x.dtype or dy.shape != x.shape:
        return NotImplemented
    B, C, S = x.shape
    K = w.shape[1]
    dx = channels_last_like(x)
    _convolve(dy, w, None, dx, reverse=True)
    chunks = cdiv(S, ROWS)
    if not dx.numel():
        sums = torch.zeros(K + 1, C, dtype=torch.float32, device=x.device)
    else:
        parts = torch.empty(B * chunks, K + 1, C, dtype=torch.float32, device=x.device)  # each program its own
        ints = (C, S, chunks, *dy.stride(), *x.stride())
        meta = dict(K=K, ROWS=ROWS, BS=BS, BC=BC, num_warps=WARPS)
        kernel = cache.template_kernel(TEMPLATES, "causal_conv1d_weight_grad.py.jinja")
        _LAUNCHES.launch(("wgrad", x.device, x.dtype, ints, K), kernel,
                         (B * chunks, cdiv(C, BC), K + 1), (dy, x, parts, *ints), meta, (dy, x, parts))
        sums = parts.sum(0)  # [K + 1, C]: the taps' sums, then the bias's
    return dx, sums[:K].t().contiguous(), sums[K] if with_bias else None
