"""The group_norm family's suite: the xlstm package's per-head layer norm, forward and train step."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_xaccel.bench.common import Case


def group_norm(N, C=1536, G=4, train=False):
    """The xlstm package's MultiHeadLayerNorm (the 7:1 stack's mLSTM head norm: 4 heads of 384 over
    B16 S1024 rows, weight only), bf16; with train, forward + backward of a mean-square loss. The
    baseline row is one copy of x."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(N, C, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(train)
        w = (1 + 0.1 * torch.randn(C, device="cuda", generator=g)).bfloat16().requires_grad_(train)

        def f(x, w):
            return F.group_norm(x, G, w, None, 1e-5)
        dense = x.detach()

        def step(fn):
            def run():
                x.grad = w.grad = None
                fn(x, w).float().square().mean().backward()
            return run
        return f, (x, w), lambda: dense.clone(), step
    return Case(f"group norm N{N} C{C} G{G}{', train step' if train else ''}", 0, make, train=train,
                baseline="one copy of x")


def cases(quick: bool) -> list[Case]:
    return [group_norm(2048 if quick else 16384), group_norm(2048 if quick else 16384, train=True)]
