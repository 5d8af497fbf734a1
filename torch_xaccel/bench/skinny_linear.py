"""The skinny_linear family's suite: the xlstm package's mLSTM gate projections, forward and train step."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_xaccel.bench.common import Case


def skinny_linear(M, width=1536, heads=4, train=False):
    """The xlstm package's mLSTM gates (the 7:1 stack's: igate and fgate of cat(q, k, v), 4 heads,
    q, k, v of 1536 over B16 S1024 rows), bf16; with train, forward + backward of a mean-square
    loss. The baseline row is one copy of q, k and v."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        qkv = [torch.randn(M, width, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(train)
               for _ in range(3)]
        ws = [(torch.randn(heads, 3 * width, device="cuda", generator=g) / 64).bfloat16().requires_grad_(train)
              for _ in range(2)]
        bs = [torch.randn(heads, device="cuda", generator=g).bfloat16().requires_grad_(train) for _ in range(2)]

        def f(q, k, v, wi, bi, wf, bf):
            x = torch.cat([q, k, v], -1)
            return F.linear(x, wi, bi) - F.linear(x, wf, bf)
        dense = torch.stack([t.detach() for t in qkv])

        def step(fn):
            def run():
                for t in (*qkv, *ws, *bs):
                    t.grad = None
                fn(*qkv, ws[0], bs[0], ws[1], bs[1]).float().square().mean().backward()
            return run
        return f, (*qkv, ws[0], bs[0], ws[1], bs[1]), lambda: dense.clone(), step
    return Case(f"mLSTM gates M{M} 3 x {width} -> 2 x {heads}{', train step' if train else ''}",
                2 * M * 3 * width * 2 * heads * (3 if train else 1), make, train=train, baseline="one copy of q, k, v")


def cases(quick: bool) -> list[Case]:
    return [skinny_linear(2048 if quick else 16384), skinny_linear(2048 if quick else 16384, train=True)]
