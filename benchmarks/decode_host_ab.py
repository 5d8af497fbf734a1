"""One-token decode of the 7B-width xLSTMLarge (batch 1 unless --batch, bf16, after a 64-token prompt), plain
calls: host-bound, so the bench's per-process timings of it spread by 20 % and more between runs
(sixteenth session: the anchor 4.97 then 4.09 ms). This times the paths in one process,
alternating rounds of wall-clock time per call (queued back to back, synchronised at the round's
end), median per path: the anchor (the package's Triton kernels, uncompiled) and xaccel on the same
compiled model with the GEMM launch plans (triton_gemm.LAUNCH_PLANS) launching their compiled
kernels directly (triton_launch.ENABLED), through JITFunction.run, and with no plans. One rest
fallback per process: two compiled instances of one model class may share Dynamo's cache entry.
For the same reason `--fast-calls off` (the eager rest calling its ATen ops as OpOverloads, not
through eager_calls.FAST_CALLS) is a process of its own, and so is `--decode-tiles off` (decode-size
GEMM chains tuned as before the eighteenth session: triton_gemm.DECODE_M_ROWS = 0, so SMALL_M's
tiles and GPU time alone; give such a process its own XACCEL_CACHE_DIR). Run on the GPU machine:

    python benchmarks/decode_host_ab.py --fallback eager|inductor [--fast-calls on|off] [--decode-tiles on|off]
        [--batch 1] [--rounds 15] [--calls 50]
        [--direct-only] [--graphed] [--profile N]

--graphed adds each path captured in a CUDA graph (replays: GPU time, no host cost). Each row also
gives the process's CPU time per token while it queues the calls. In the eighteenth session it
equalled the wall time: the host ran busy throughout, at a speed that varied up to 2x (the anchor
3.5-6.8 ms a token in one process), so only paths timed in one process compare.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def decoder(kernels: dict, fallback: str | None, batch: int = 1):
    """A one-token call of the model with these kernels, compiled by xaccel with this rest
    fallback (None: uncompiled)."""
    from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

    cfg = xLSTMLargeConfig(vocab_size=50304, chunk_size=64, mode="inference", return_last_states=True,
                           embedding_dim=4096, num_heads=8, num_blocks=4, **kernels)
    torch.manual_seed(0)
    with torch.device("cuda"):  # (built on the GPU: the 7B-width blocks' fp32 init takes ~20 s on the host)
        model = xLSTMLarge(cfg).to(torch.bfloat16)
    if fallback is not None:
        os.environ["XACCEL_FALLBACK"] = fallback
        model = torch.compile(model, backend="xaccel")
    with torch.inference_mode():
        _, state = model(torch.randint(0, 50304, (batch, 64), device="cuda"))
        tok = torch.randint(0, 50304, (batch, 1), device="cuda")
        for _ in range(5):  # compile, tune, settle
            model(tok, state)
    torch.cuda.synchronize()

    def call():
        with torch.inference_mode():
            model(tok, state)
    return call


def main() -> None:
    from torch_xaccel import eager_calls
    from torch_xaccel.bench import ANCHOR_KERNELS, NATIVE_KERNELS
    from torch_xaccel.codegen import triton_gemm, triton_launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--fallback", default="eager", choices=("eager", "inductor"))
    ap.add_argument("--fast-calls", default="on", choices=("on", "off"))
    ap.add_argument("--decode-tiles", default="on", choices=("on", "off"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--direct-only", action="store_true", help="xaccel with its launch plans launched directly only")
    ap.add_argument("--graphed", action="store_true", help="also each path's CUDA-graph replay")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="afterwards, each path's host time under cProfile: N calls, top functions")
    args = ap.parse_args()
    eager_calls.ENABLED = args.fast_calls == "on"
    if args.decode_tiles == "off":
        triton_gemm.DECODE_M_ROWS = 0
    calls = {"anchor (xlstm Triton kernels)": decoder(ANCHOR_KERNELS, None, args.batch),
             f"xaccel, rest {args.fallback}, fast calls {args.fast_calls}, decode tiles {args.decode_tiles}":
             decoder(NATIVE_KERNELS, args.fallback, args.batch)}
    if args.graphed:
        from torch_xaccel.bench import _graphed

        calls.update({f"{name}, CUDA graph": _graphed(call) for name, call in list(calls.items())})
    settings = {"": (True, True), ", launch plans launched directly": (True, True),
                ", launch plans through JITFunction.run": (True, False), ", no launch plans": (False, False)}
    if args.direct_only:
        del settings[", launch plans through JITFunction.run"], settings[", no launch plans"]
    arms = [(name, label) for name in calls for label in settings
            if (label != "") == ("xaccel" in name and "graph" not in name)]
    times: dict = {arm: [] for arm in arms}
    cpu: dict = {arm: [] for arm in arms}
    for _ in range(args.rounds):
        for name, label in arms:
            triton_gemm.LAUNCH_PLANS, triton_launch.ENABLED = settings[label]
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.calls):
                calls[name]()
            c1 = time.process_time()
            torch.cuda.synchronize()
            times[(name, label)].append((time.perf_counter() - t0) * 1e3 / args.calls)
            cpu[(name, label)].append((c1 - c0) * 1e3 / args.calls)
    triton_gemm.LAUNCH_PLANS = triton_launch.ENABLED = True
    for (name, label), ms in times.items():
        print(f"{name + label:85s} median {statistics.median(ms):.3f} ms per token (min {min(ms):.3f}, max {max(ms):.3f}, "
              f"{args.rounds} rounds x {args.calls} calls; CPU time {statistics.median(cpu[(name, label)]):.3f} ms)",
              flush=True)
    if args.profile:
        import cProfile
        import pstats

        for name, call in calls.items():
            if "graph" in name:
                continue
            print(f"--- {name}: {args.profile} calls under cProfile", flush=True)
            prof = cProfile.Profile()
            prof.runcall(lambda: [call() for _ in range(args.profile)])
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
