"""Where the host time of a one-token decode step of the xlstm package's xLSTMBlockStack goes
(E768, 4 heads, bf16, its sLSTM on the vanilla backend): the step compiled with backend="xaccel"
against the same step uncompiled, each called plainly (no CUDA graph), under cProfile: the time
per token, then the functions with the most own time. Run on the GPU machine:

    python benchmarks/decode_host_profile.py [--slstm-at 7] [--blocks 8] [--batch 1] [--calls 200] [--top 30]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from torch_xaccel.bench import _slstm_stack


def _per_token(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--slstm-at", default="7", help="comma-separated sLSTM block indices")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    slstm_at = tuple(int(a) for a in args.slstm_at.split(","))
    model = _slstm_stack(768, args.blocks, slstm_at, "vanilla", args.batch, 1024).eval()
    x = torch.randn(args.batch, 1, 768, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        state = model.step(x)[1]
        for label, fn in (("compiled with xaccel", torch.compile(model.step, backend="xaccel")),
                          ("uncompiled", model.step)):
            def token(fn=fn):
                fn(x, state)
            for _ in range(20):
                token()
            plain = _per_token(token, args.calls)
            prof = cProfile.Profile()
            prof.enable()
            profiled = _per_token(token, args.calls)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
            print(f"=== {label}: {plain:.3f} ms per token plain, {profiled:.3f} ms under cProfile", flush=True)
            print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main()
