"""xaccel::causal_conv1d: y[b, c, s] = bias[c] + sum_k w[c, k] x[b, c, s + k - (K - 1)], positions
before the start reading zero.

What `conv1d(x, w[C, 1, K], bias, padding=K - 1, groups=C)[..., :S]` computes (the xlstm
package's CausalConv1d), or a depthwise conv1d of x left-padded by K - 1 zeros. fp16/bf16 inputs
are computed in fp32 and rounded once to x's dtype, as the kernels do. The result has channels
innermost in memory ([B, S, C] seen as [B, C, S]): the layout the usual transpose back to
[B, S, C] makes dense."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def channels_last_like(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An empty [B, C, S] tensor with channels innermost (the op's output and input-gradient layout)."""
    B, C, S = x.shape
    return x.new_empty(B, S, C, dtype=dtype or x.dtype).transpose(1, 2)


def forward(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x [B, C, S], w [C, K], bias [C] or None -> y [B, C, S] in x's dtype."""
    if x.numel() == 0:  # (conv1d refuses S = 0 where K - 1 zeros of padding are fewer than K)
        return channels_last_like(x)
    cd, (C, K) = compute_dtype(x), w.shape
    y = F.conv1d(F.pad(x.to(cd), (K - 1, 0)), w.to(cd).unsqueeze(1), None if bias is None else bias.to(cd),
                 groups=C)
    out = channels_last_like(x)
    out.copy_(y)
    return out


def backward(dy: Tensor, x: Tensor, w: Tensor, with_bias: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dx [B, C, S] in x's dtype and layout, dw [C, K] and dbias [C] or None in the compute dtype)."""
    cd, (C, K), S = compute_dtype(x), w.shape, x.shape[-1]
    if x.numel() == 0:  # nothing to convolve: the weight and bias gradients are sums of nothing
        return channels_last_like(x), w.new_zeros(C, K, dtype=cd), w.new_zeros(C, dtype=cd) if with_bias else None
    g, xc = dy.to(cd), x.to(cd)
    # dx[t] = sum_k w[k] dy[t + K - 1 - k]: the same convolution, anti-causal, with w reversed
    dx = channels_last_like(x)
    dx.copy_(F.conv1d(F.pad(g, (0, K - 1)), w.to(cd).flip(-1).unsqueeze(1), groups=C))
    xp = F.pad(xc, (K - 1, 0))
    dw = torch.stack([(g * xp[..., k:k + S]).sum((0, 2)) for k in range(K)], 1)
    return dx, dw, g.sum((0, 2)) if with_bias else None
