"""The gemm_epilogue family's suite: GEMM + epilogue chains, a SwiGLU MLP and an MLP train step
beside the cuBLAS matmuls alone, eager and Inductor."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_xaccel.bench.common import Case

# what the suite runs under unless the caller set it: CUTLASS kernels built before tuning, so every
# call is timed with them (the CLI applies a suite module's ENV)
ENV = {"XACCEL_CUTLASS": "wait"}


def kernels_picked():
    """A function naming the GEMM kernels tuned since this call ("ATen" where tuning timed ATen
    faster, "cached" where nothing was tuned): the xaccel row's notes (Case.kernels)."""
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    before = dict(gemm_kernels._DECISIONS)

    def picked() -> str:
        return "; ".join(("ATen" if v is None else "/".join(map(str, v))) for k, v in gemm_kernels._DECISIONS.items()
                         if k not in before) or "cached"
    return picked


def gelu_residual(M, K=4096, N=16384):
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
        res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)

        def f(x, W, b, res):
            return F.gelu(F.linear(x, W, b), approximate="tanh") + res
        return f, (x, W, b, res), lambda: x @ W.t()
    return Case(f"gelu_tanh(linear(x,W,b))+res M{M} K{K} N{N}", 2 * M * N * K, make, graphs=M <= 256,
                kernels=kernels_picked)


def swiglu(M, d=4096, h=11008):
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g) / s[-1] ** 0.5  # noqa: E731
        x, w1, w3, w2 = mk(M, d), mk(h, d), mk(h, d), mk(d, h)

        def f(x, w1, w3, w2):
            return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
        hid = torch.empty(M, h, device="cuda", dtype=torch.bfloat16)

        def cublas():
            torch.mm(x, w1.t(), out=hid)
            torch.mm(x, w3.t(), out=hid)
            return hid @ w2.t()
        return f, (x, w1, w3, w2), cublas
    return Case(f"SwiGLU MLP fwd M{M} {d}->2x{h}->{d}", 2 * M * d * h * 3, make, kernels=kernels_picked)


def mlp_train(M, d=2048, h=8192, layers=4):
    def make():
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList()
        for _ in range(layers):
            blocks.append(torch.nn.Linear(d, h))
            blocks.append(torch.nn.Linear(h, d))
        blocks = blocks.to("cuda", torch.bfloat16)
        x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def f(x):
            for i in range(0, len(blocks), 2):
                x = blocks[i + 1](F.gelu(blocks[i](x), approximate="tanh")) + x
            return x

        def step(fn):
            def run():
                for p in blocks.parameters():
                    p.grad = None
                fn(x).float().square().mean().backward()
            return run
        ws = [(blk.weight) for blk in blocks]
        hid = torch.empty(M, h, device="cuda", dtype=torch.bfloat16)

        def cublas():  # the same GEMMs, forward and backward, with no elementwise work
            with torch.no_grad():
                for i in range(0, len(ws), 2):
                    torch.mm(x, ws[i].t(), out=hid)
                    y = hid @ ws[i + 1].t()
                    _ = y @ ws[i + 1], y.t() @ hid, hid @ ws[i], hid.t() @ x
        return f, (x,), cublas, step
    return Case(f"train step {layers}-layer MLP M{M} {d}->{h}->{d} (fwd+bwd)", 3 * 2 * M * d * h * 2 * layers, make,
                train=True, kernels=kernels_picked)


def cases(quick: bool) -> list[Case]:
    return [gelu_residual(4096 if quick else 16384), gelu_residual(128), swiglu(4096 if quick else 16384),
            mlp_train(4096 if quick else 16384)]
