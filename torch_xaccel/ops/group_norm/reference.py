"""xaccel::group_norm: y[n, c] = (x[n, c] - mean) * rstd * weight[c] + bias[c], mean and
rstd = 1 / sqrt(var + eps) (biased variance) over the C / groups channels of c's group in row n.

What `F.group_norm(x, groups, weight, bias, eps)` computes on x [N, C]: a layer norm per group of
channels, as the xlstm package's MultiHeadLayerNorm applies it per head. fp16/bf16 inputs are
computed in fp32 and rounded once to x's dtype, as the kernels do."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _cast(t: Tensor | None, dtype) -> Tensor | None:
    return None if t is None else t.to(dtype)


def forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, groups: int, eps: float) -> Tensor:
    """x [N, C], weight and bias [C] or None -> y [N, C] in x's dtype, contiguous."""
    cd = compute_dtype(x)
    return F.group_norm(x.to(cd), groups, _cast(weight, cd), _cast(bias, cd), eps).to(x.dtype).contiguous()


def backward(dy: Tensor, x: Tensor, weight: Tensor | None, groups: int, eps: float, with_bias: bool):
    """(dx [N, C] in x's dtype, dweight and dbias [C] in the compute dtype or None where absent):
    with xhat the normalized x and g = dy * weight, dx = rstd (g - mean(g) - xhat mean(g xhat))
    over each row's group; dweight = sum over rows of dy xhat, dbias = sum over rows of dy."""
    cd = compute_dtype(x)
    N, C = x.shape
    if x.numel() == 0:  # no rows (or channels): the weight and bias gradients are sums of nothing
        zeros = x.new_zeros(C, dtype=cd)
        return x.new_empty(N, C), zeros if weight is not None else None, zeros.clone() if with_bias else None
    xg = x.to(cd).view(N, groups, -1)
    mean = xg.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xg.var(-1, unbiased=False, keepdim=True) + eps)
    xhat = (xg - mean) * rstd
    dyg = dy.to(cd).view(N, groups, -1)
    g = dyg * (weight.to(cd).view(groups, -1) if weight is not None else 1.0)
    dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dyg * xhat).sum(0).reshape(C) if weight is not None else None
    db = dyg.sum(0).reshape(C) if with_bias else None
    return dx.reshape(N, C).to(x.dtype), dw, db
