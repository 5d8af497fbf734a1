"""The headwise family's suite: the xlstm package's per-head q/k/v projection, forward and train step."""
from __future__ import annotations

import torch

from torch_xaccel.bench.common import Case


def headwise(M, H=384, D=4, DO=4, train=False):
    """The xlstm package's q/k/v projection (LinearHeadwiseExpand, 384 heads of 4 x 4 at inner
    width 1536) over M rows, bf16; with train, forward + backward of a mean-square loss. The
    cuBLAS row is the batched GEMM that eager's einsum runs, on operands already permuted."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, H * D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(train)
        w = (torch.randn(H, DO, D, device="cuda", generator=g) / D ** 0.5).bfloat16().requires_grad_(train)

        def f(x, w):
            return torch.einsum("...hd,hod->...ho", x.view(M, H, D), w).reshape(M, H * DO)
        xp, wt = x.detach().view(M, H, D).transpose(0, 1).contiguous(), w.detach().transpose(1, 2).contiguous()

        def step(fn):
            def run():
                x.grad = w.grad = None
                fn(x, w).float().square().mean().backward()
            return run
        return f, (x, w), lambda: torch.bmm(xp, wt), step
    return Case(f"headwise einsum M{M}, {H} heads of {D}x{DO}{', train step' if train else ''}",
                2 * M * H * DO * D * (3 if train else 1), make, train=train)


def cases(quick: bool) -> list[Case]:
    return [headwise(2048 if quick else 16384), headwise(2048 if quick else 16384, train=True)]
