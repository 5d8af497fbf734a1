"""The main job: compile a small model with backend="xaccel", check it against eager, print the report.

    python -m torch_xaccel.demo            # CPU: the reference path; CUDA GPU: the kernels (bf16)

Today the model is a stack of transformer-style MLP blocks (GEMM + elementwise chains, SwiGLU);
the mLSTM and sLSTM blocks join it as their kernels land. Exit status 1 if compiled != eager.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class GeluMLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.norm(x)), approximate="tanh")) + x


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.w2(F.silu(self.w1(h)) * self.w3(h)) + x


class DemoModel(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, vocab: int = 101):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(m for _ in range(layers) for m in (SwiGLU(d, 4 * d), GeluMLP(d, 4 * d)))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args(argv)
    import torch_xaccel

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.manual_seed(0)
    model = DemoModel().to(dev, dtype)
    tokens = torch.randint(0, 101, (args.batch, args.seq), device=dev)
    print(f"torch_xaccel {torch_xaccel.__version__} | torch {torch.__version__} | {dev} {dtype}")

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        logits = fn(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
        return logits.detach().float(), [q.grad.float() for q in model.parameters()]

    ref, ref_g = loss_and_grads(model)
    compiled = torch.compile(model, backend="xaccel")
    t0 = time.perf_counter()
    out, out_g = loss_and_grads(compiled)
    compile_s = time.perf_counter() - t0
    err = ((out - ref).norm() / ref.norm()).item()
    gerr = max(((g - r).norm() / r.norm().clamp_min(1e-30)).item() for g, r in zip(out_g, ref_g))
    print(f"first compiled step (compile + run): {compile_s:.1f} s")
    print(f"logits: max |compiled - eager| = {(out - ref).abs().max().item():.3e}, relative error {err:.2e}")
    print(f"gradients: worst relative error over {len(out_g)} parameters {gerr:.2e} (tolerance {tol:g})")
    print(torch_xaccel.last_report())
    ok = err <= tol and gerr <= tol * 5
    print("OK: compiled model matches eager" if ok else "MISMATCH: compiled model differs from eager")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
