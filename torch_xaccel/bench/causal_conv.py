"""The causal_conv family's suite: the xlstm package's causal depthwise convolution, forward and train step."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_xaccel.bench.common import Case


def causal_conv(B, S, C=1536, K=4, train=False):
    """The xlstm package's CausalConv1d (the 7:1 stack's mLSTM convolution at inner width 1536,
    kernel size 4: its input a [B, S, C] slice seen as [B, C, S], the output transposed back),
    bf16; with train, forward + backward of a mean-square loss. The baseline row is one copy of x:
    the memory traffic a fused convolution cannot go below."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(B, S, 2 * C, device="cuda", dtype=torch.bfloat16, generator=g)[..., :C]
        x = x.detach().requires_grad_(train) if train else x
        w = (torch.randn(C, 1, K, device="cuda", generator=g) / K ** 0.5).bfloat16().requires_grad_(train)
        b = torch.randn(C, device="cuda", generator=g).bfloat16().requires_grad_(train)

        def f(x, w, b):
            return F.conv1d(x.transpose(1, 2), w, b, padding=K - 1, groups=C)[..., :-(K - 1)].transpose(1, 2)
        dense = x.detach().contiguous()

        def step(fn):
            def run():
                x.grad = w.grad = b.grad = None
                fn(x, w, b).float().square().mean().backward()
            return run
        return f, (x, w, b), lambda: dense.clone(), step
    return Case(f"causal conv1d B{B} S{S} C{C} K{K}{', train step' if train else ''}",
                2 * B * S * C * K * (3 if train else 1), make, train=train, baseline="one copy of x")


def cases(quick: bool) -> list[Case]:
    return [causal_conv(2 if quick else 16, 1024), causal_conv(2 if quick else 16, 1024, train=True)]
