"""xaccel::headwise: y[..., h, o] = sum_d x[..., h, d] w[h, o, d], one small linear map per head.

What the xlstm package's LinearHeadwiseExpand computes (`einsum("...hd,hod->...ho")`, its q, k
and v projections with blocks of 4), and any einsum of that structure. fp16/bf16 inputs are
computed in fp32 and rounded once to x's dtype, as the kernels do.

The optional addend (a tensor of y's shape and dtype) is added before that rounding: a backward
graph's gradient sum `dx + other`, folded into the op that computes dx (gradient_sums.py), costs
no extra pass over memory."""
from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def forward(x: Tensor, w: Tensor, addend: Tensor | None = None) -> Tensor:
    """x [..., H, D], w [H, O, D], addend [..., H, O] or None -> [..., H, O] in x's dtype."""
    cd = compute_dtype(x)
    y = torch.einsum("...hd,hod->...ho", x.to(cd), w.to(cd))
    return (y if addend is None else y + addend.to(cd)).to(x.dtype)


def weight_grad(dy: Tensor, x: Tensor) -> Tensor:
    """dw [H, O, D] = sum over the leading dims of dy[..., h, o] x[..., h, d], in the compute dtype."""
    cd = compute_dtype(x)
    return torch.einsum("...ho,...hd->hod", dy.to(cd), x.to(cd))
