"""Where the host time of a one-token decode step goes, compiled with backend="xaccel" against the
same step uncompiled, each called plainly (no CUDA graph): first the time per token of both paths
alternating in rounds (plain decode is host-bound and drifts within a process, so only alternating
rows compare), then each path under cProfile with the functions of the most own time.

Models: the xlstm package's xLSTMBlockStack (E768, 4 heads, bf16, its sLSTM on the vanilla
backend; `stack`) or transformers' xLSTMForCausalLM at 7B widths without the xlstm package, after a
64-token prompt, through its own cache (`transformers`). Run on the GPU machine:

    python benchmarks/decode_host_profile.py [--model stack|transformers] [--slstm-at 7] [--blocks 8]
        [--batch 1] [--calls 200] [--rounds 8] [--top 30]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from torch_xaccel.bench.common import _sync
from torch_xaccel.bench.model import transformers_cache, transformers_cache_of, transformers_xlstm_without_package
from torch_xaccel.bench.slstm import _slstm_stack


def _per_token(fn, calls: int) -> float:
    _sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync()
    return (time.perf_counter() - t0) / calls * 1e3


def _stack_tokens(args, dev):
    """(uncompiled token, compiled token) of the xlstm package's block stack."""
    slstm_at = tuple(int(a) for a in args.slstm_at.split(","))
    model = _slstm_stack(768, args.blocks, slstm_at, "vanilla", args.batch, 1024).eval()
    x = torch.randn(args.batch, 1, 768, device=dev, dtype=torch.bfloat16)
    state = model.step(x)[1]
    compiled = torch.compile(model.step, backend="xaccel")
    return (lambda: model.step(x, state)), (lambda: compiled(x, state))


def _transformers_tokens(args, dev):
    """(uncompiled token, compiled token) of transformers' model, each with its own cache."""
    modeling = transformers_xlstm_without_package()
    dims = dict(hidden_size=4096, num_heads=8, num_blocks=4) if dev == "cuda" else \
        dict(hidden_size=256, num_heads=4, num_blocks=2)  # (a CPU run checks the script, not the figures)
    cfg = modeling.xLSTMConfig(vocab_size=50304, chunk_size=64, mode="inference", use_cache=False, **dims)
    torch.manual_seed(0)
    model = modeling.xLSTMForCausalLM(cfg).to(dev, torch.bfloat16).eval()
    prompt = torch.randint(0, 50304, (args.batch, 64), device=dev)
    tok = torch.randint(0, 50304, (args.batch, 1), device=dev)

    def token_of(fn):
        cache = transformers_cache_of(fn(prompt, use_cache=True))
        kw = dict(use_cache=True, **transformers_cache(modeling, cache))
        return lambda: fn(tok, **kw).logits
    return token_of(model), token_of(torch.compile(model, backend="xaccel"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["stack", "transformers"], default="stack")
    p.add_argument("--slstm-at", default="7", help="comma-separated sLSTM block indices (stack)")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.inference_mode():
        uncompiled, compiled = (_stack_tokens if args.model == "stack" else _transformers_tokens)(args, dev)
        paths = {"uncompiled": uncompiled, "compiled with xaccel": compiled}
        for fn in paths.values():
            for _ in range(20):
                fn()
        times = {label: [] for label in paths}
        for _ in range(args.rounds):
            for label, fn in paths.items():
                times[label].append(_per_token(fn, args.calls))
        medians = {label: statistics.median(t) for label, t in times.items()}
        print(f"{args.model} B{args.batch}, ms per token plain (median of {args.rounds} alternating rounds of "
              f"{args.calls} calls): " + ", ".join(f"{label} {ms:.3f}" for label, ms in medians.items())
              + f"; compiled / uncompiled {medians['compiled with xaccel'] / medians['uncompiled']:.3f}", flush=True)
        for label, fn in paths.items():
            prof = cProfile.Profile()
            prof.enable()
            profiled = _per_token(fn, args.calls)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
            print(f"=== {label}: {profiled:.3f} ms per token under cProfile", flush=True)
            print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main()
