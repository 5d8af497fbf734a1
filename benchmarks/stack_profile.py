"""Where the xlstm package's xLSTMBlockStack spends its time (E768 and 4 heads unless given, B16
S1024, bf16, its sLSTM on the vanilla backend, compiled with backend="xaccel"): prefill and train step (forward +
backward of a mean-square loss) under the torch profiler, the top kernels by GPU time, then the
ATen ops by self GPU time with their input shapes (where the copies come from), then where the GPU
sat idle and what the host did meanwhile (model_profile's --gaps), the calls that make the host
wait for the GPU, and the Python functions by own and cumulative time (where a host-bound step
spends its CPU time). Run on the GPU machine:

    python benchmarks/stack_profile.py [--slstm-at 7] [--blocks 8] [--top 40] [--embedding 2048 --heads 8]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import warnings

import torch
from model_profile import idle_gaps  # benchmarks/ is on the path when this script runs
from torch.profiler import ProfilerActivity, profile

from torch_xaccel.bench.slstm import _slstm_stack


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--slstm-at", default="7", help="comma-separated sLSTM block indices")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--embedding", type=int, default=768)
    p.add_argument("--heads", type=int, default=4, help="of the sLSTM and the mLSTM layers")
    args = p.parse_args()
    slstm_at = tuple(int(a) for a in args.slstm_at.split(","))
    model = _slstm_stack(args.embedding, args.blocks, slstm_at, "vanilla", 16, 1024, args.heads)
    fn = torch.compile(model, backend="xaccel")
    x = torch.randn(16, 1024, args.embedding, device="cuda", dtype=torch.bfloat16)

    def prefill():
        with torch.inference_mode():
            fn(x)

    def train():
        fn(x).float().square().mean().backward()

    for name, run in (("prefill", prefill), ("train step", train)):
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 5 * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            run()
            torch.cuda.synchronize()
        averages = prof.key_averages()
        kernels = [e for e in averages if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
        print(f"\n=== {name}: wall {wall:.3f} ms, kernel time "
              f"{sum(e.self_device_time_total for e in kernels) / 1e3:.3f} ms", flush=True)
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.top]:
            print(f"  {e.self_device_time_total / 1e3:8.3f} ms x{e.count:<4d} {e.key[:120]}", flush=True)
        ops = [e for e in prof.key_averages(group_by_input_shape=True)
               if e.device_type.name == "CPU" and e.key.startswith(("aten::", "xaccel::")) and e.device_time_total > 0]
        print(f"--- {name}: ATen and xaccel ops by GPU time, with input shapes", flush=True)
        for e in sorted(ops, key=lambda e: -e.device_time_total)[:args.top]:
            print(f"  {e.device_time_total / 1e3:8.3f} ms x{e.count:<4d} {e.key[:32]:32s} {str(e.input_shapes)[:120]}",
                  flush=True)
        idle_gaps(run, args.top)
        _syncs(name, run)
        _host_python(name, run, args.top)


def _syncs(name: str, run) -> None:
    """The calls in one step that make the host wait for the GPU (torch's sync debug mode): each
    one lets the GPU drain and then sit idle while the host launches again."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    found = [w for w in caught if "synchroniz" in str(w.message)]
    print(f"--- {name}: {len(found)} synchronizing call(s) in one step", flush=True)
    for w in found[:10]:
        print(f"  {w.filename}:{w.lineno}: {str(w.message)[:100]}", flush=True)


def _host_python(name: str, run, top: int) -> None:
    """Five steps under cProfile: the Python functions with the most own time (a Triton launcher,
    the runtime's dispatch, a wrapper), which the torch profiler's op table does not show."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    prof.disable()
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(top)
        print(f"--- {name}: Python functions by {order} time over 5 steps (cProfile)", flush=True)
        print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main()
