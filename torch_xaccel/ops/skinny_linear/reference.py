"""xaccel::skinny_linear: y = cat(xs, -1) @ weight^T + bias, xs [..., K_j] with equal leading
dims, weight [N, sum K_j], bias [N] or None, y [..., N] in the inputs' dtype.

What the user wrote, `F.linear(torch.cat(xs, -1), weight, bias)` (one or more linears of the same
input, their weights stacked): ATen rounds fp16/bf16 products accumulated in fp32 once, as the
kernels do. The backward is the linear's: dxs = the column blocks of dy @ weight, dweight =
dy^T cat(xs), dbias = the row sum of dy, the latter two in the compute dtype. The backward adds
addends[j] (a tensor like xs[j], or None) to dx_j before rounding it to the inputs' dtype: a
backward graph's gradient sum `dx_j + other`, folded into the op (gradient_sums.py), costs no
extra pass over memory."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def forward(weight: Tensor, bias: Tensor | None, xs: list[Tensor]) -> Tensor:
    return F.linear(xs[0] if len(xs) == 1 else torch.cat(xs, -1), weight, bias)


def backward(dy: Tensor, weight: Tensor, xs: list[Tensor], with_bias: bool,
             addends: list[Tensor | None] | None = None) -> list[Tensor]:
    """[dx_0, ..., dx_n (+ addends; in the inputs' dtype, contiguous), dweight [N, K], dbias [N]
    (compute dtype; empty without a bias)]."""
    cd = compute_dtype(weight)
    N = weight.shape[0]
    rows = dy.reshape(-1, N)
    added = addends is not None and any(a is not None for a in addends)
    dx = ((rows.to(cd) @ weight.to(cd)) if added else rows @ weight).split([x.shape[-1] for x in xs], -1)
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs], -1)
    dweight = rows.to(cd).T @ x.to(cd)
    dbias = rows.to(cd).sum(0) if with_bias else dy.new_empty(0, dtype=cd)
    dxs = [d.reshape(t.shape) for d, t in zip(dx, xs)]
    if added:
        dxs = [d if a is None else d + a.to(cd) for d, a in zip(dxs, addends)]
    return [d.to(t.dtype).contiguous() for d, t in zip(dxs, xs)] + [dweight, dbias]
