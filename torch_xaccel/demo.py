"""The main job: compile a small model with backend="xaccel", check it against eager, print the report.

    python -m torch_xaccel.demo            # CPU: the reference path; CUDA GPU: the kernels (bf16)

The model stacks mLSTM mixing blocks (the parallel form), sLSTM mixing blocks (a loop over time
steps) and transformer-style MLP blocks (GEMM + elementwise chains, SwiGLU), all written in plain
PyTorch. Exit status 1 if compiled != eager.
"""
from __future__ import annotations

import argparse
import math
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


def mlstm_parallel(q, k, v, i, f, eps: float = 1e-6):
    """The stabilized parallel mLSTM as a user would write it (the formula in docs/architecture.md)."""
    S, D = q.shape[-2], q.shape[-1]
    Fc = torch.cumsum(F.logsigmoid(f), dim=-1)
    mask = torch.tril(torch.ones(S, S, dtype=torch.bool, device=q.device))
    logD = (Fc[..., :, None] - Fc[..., None, :] + i[..., None, :]).masked_fill(~mask, float("-inf"))
    m = logD.amax(dim=-1, keepdim=True)
    C = (q @ k.transpose(-2, -1)) / math.sqrt(D) * torch.exp(logD - m)
    n = torch.maximum(C.sum(-1, keepdim=True).abs(), torch.exp(-m))
    return (C / (n + eps)) @ v


class MLSTMBlock(nn.Module):
    """Pre-norm mLSTM mixing layer; the recurrence runs in fp32, as xLSTM code usually does."""

    def __init__(self, d: int, heads: int = 4):
        super().__init__()
        self.h, self.norm = heads, nn.LayerNorm(d)
        self.qkv, self.gates, self.out = (nn.Linear(d, 3 * d, bias=False), nn.Linear(d, 2 * heads),
                                          nn.Linear(d, d, bias=False))

    def forward(self, x):
        B, S, d = x.shape
        y = self.norm(x)
        q, k, v = (t.view(B, S, self.h, d // self.h).transpose(1, 2).float() for t in self.qkv(y).chunk(3, -1))
        i, f = (t.transpose(1, 2).float() for t in self.gates(y).chunk(2, -1))
        h = mlstm_parallel(q, k, v, i, f).to(x.dtype)
        return self.out(h.transpose(1, 2).reshape(B, S, d)) + x


class SLSTMBlock(nn.Module):
    """Pre-norm sLSTM mixing layer written as a loop over time steps: per head a [4D, D] recurrent
    block, exponential input and forget gates with a max-stabilizer, fresh rows where n == 0. The
    recurrence runs in fp32."""

    def __init__(self, d: int, heads: int = 4):
        super().__init__()
        self.h, self.norm = heads, nn.LayerNorm(d)
        self.wx, self.out = nn.Linear(d, 4 * d), nn.Linear(d, d, bias=False)
        self.R = nn.Parameter(torch.randn(heads, 4 * (d // heads), d // heads) / math.sqrt(d // heads))

    def forward(self, x):
        B, S, d = x.shape
        H, D = self.h, d // self.h
        wx = self.wx(self.norm(x)).float().view(B, S, 4, H, D)
        R = self.R.float()
        h = c = n = m = torch.zeros(B, H, D, device=x.device)
        ys = []
        for t in range(S):
            raw = wx[:, t] + torch.einsum("bhk,hjk->bhj", h, R).view(B, H, 4, D).transpose(1, 2)
            i, f, z, o = raw.unbind(1)
            logfm = m + F.logsigmoid(f)
            m_new = torch.where(n == 0, i, torch.maximum(i, logfm))
            ig, fg = torch.exp(i - m_new), torch.exp(logfm - m_new)
            c = fg * c + ig * torch.tanh(z)
            n = fg * n + ig
            h, m = torch.sigmoid(o) * c / n, m_new
            ys.append(h)
        y = torch.stack(ys, 1).reshape(B, S, d).to(x.dtype)
        return self.out(y) + x


class DemoModel(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, vocab: int = 101):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(m for _ in range(layers)
                                    for m in (MLSTMBlock(d), SwiGLU(d, 4 * d), SLSTMBlock(d), GeluMLP(d, 4 * d)))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _onnx_check(model, tokens) -> bool:
    """Export an fp32 CPU copy with torch_xaccel.onnx, its batch dim symbolic, and run it in
    onnxruntime at the demo's batch size and one more; prints one line."""
    import copy
    import tempfile
    import warnings

    try:
        import onnxruntime

        from torch_xaccel import onnx as xonnx
    except ImportError as e:
        print(f"ONNX: skipped ({e}; pip install onnx onnxscript onnxruntime)")
        return True
    cpu, tokens = copy.deepcopy(model).float().cpu().eval(), tokens.cpu()
    batches = (tokens, torch.cat([tokens, tokens[:1].flip(1)]))
    errs = []
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.export's pytree deprecation notes
        t0 = time.perf_counter()
        # traced at the larger batch: a symbolic size's example value must be 2 or more
        res = xonnx.export(cpu, (batches[1],), f"{d}/demo.onnx", dynamic_shapes=({0: torch.export.Dim("batch")},),
                           report=False)
        seconds = time.perf_counter() - t0
        session = onnxruntime.InferenceSession(res.path, providers=["CPUExecutionProvider"])
        for x in batches:
            got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
            with torch.no_grad():
                want = cpu(x)
            errs.append(((got - want).norm() / want.norm()).item())
    print(f"ONNX: exported in {seconds:.1f} s (batch dim symbolic), xaccel nodes {res.nodes()}; onnxruntime vs "
          f"eager relative error {max(errs):.2e} at batch {' and '.join(str(len(x)) for x in batches)}")
    return max(errs) <= 1e-5


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
    onnx_ok = _onnx_check(model, tokens)
    ok = err <= tol and gerr <= tol * 5 and onnx_ok
    print("OK: compiled model matches eager" if ok else "MISMATCH: compiled model differs from eager")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
