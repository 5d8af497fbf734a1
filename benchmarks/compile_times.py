"""How long does the first call of the 7B-width xLSTMLarge take, cold and with warm caches?

First-call (compile) time of the 7B-width xLSTMLarge (B4 x 2048 tokens, bf16, native
configuration) compiled with backend="xaccel": prefill and train step, no steady-state timing.
Run it twice with the same XACCEL_CACHE_DIR (and Inductor's cache, TORCHINDUCTOR_CACHE_DIR): the
first process measures the cold compile, the second the warm one.
Per mode it prints the first call's seconds, how many tuning decisions were timed in it (a warm
process should time none) and Inductor's cache counters. Run on the GPU machine:

    python benchmarks/compile_times.py [--fallback eager|inductor] [--modes prefill,train]

(`--small` on a CPU: the code path at 256 wide, 2 blocks, 1 x 64 tokens, fp32; not a timing.)
"""
from __future__ import annotations

import argparse
import os
import time

import torch


def first_call(mode: str, small: bool) -> float:
    from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

    from torch_xaccel.bench.model import NATIVE_KERNELS

    width, blocks, vocab, (B, S) = (256, 2, 1024, (1, 64)) if small else (4096, 4, 50304, (4, 2048))
    dev, dtype = ("cpu", torch.float32) if small else ("cuda", torch.bfloat16)
    cfg = xLSTMLargeConfig(vocab_size=vocab, chunk_size=64, mode="inference" if mode == "prefill" else "train",
                           return_last_states=mode == "train", embedding_dim=width, num_heads=8, num_blocks=blocks,
                           **NATIVE_KERNELS)
    torch.manual_seed(0)
    model = xLSTMLarge(cfg).to(dev, dtype)
    tokens = torch.randint(0, vocab, (B, S), device=dev)
    fn = torch.compile(model, backend="xaccel")
    t0 = time.perf_counter()
    if mode == "prefill":
        with torch.inference_mode():
            fn(tokens)
    else:
        logits = fn(tokens)[0]
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    if not small:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    from torch._dynamo.utils import counters

    from torch_xaccel.codegen import cache

    ap = argparse.ArgumentParser()
    ap.add_argument("--fallback", default="inductor", choices=("eager", "inductor"))
    ap.add_argument("--modes", default="prefill,train")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    os.environ["XACCEL_FALLBACK"] = args.fallback
    timed, real = [], cache.write_entry

    def counted(kind, key, value):  # a tuning decision is written once it has been timed
        if kind == "tuning":
            timed.append(key)
        real(kind, key, value)
    cache.write_entry = counted
    for mode in args.modes.split(","):
        torch._dynamo.reset()
        counters.clear()
        timed.clear()
        seconds = first_call(mode, args.small)
        caches = {k: v for k, v in {**counters["aot_autograd"], **counters["inductor"]}.items() if "cache" in k}
        print(f"{args.fallback} rest, {mode}: first call {seconds:.1f} s, {len(timed)} tuning decisions timed, "
              f"caches {caches}", flush=True)


if __name__ == "__main__":
    main()
