"""Is a compiled sweep row bound by the host or by the GPU, and which ops hold the host?

For each sweep row given (labels as `bench sweep --list` prints them), the model uncompiled,
under Inductor, under xaccel as it chooses, and under xaccel with every replacement kept
(XACCEL_CHOOSE=0) beside the eager and the Inductor rest, each timed three ways after warm-up:
- wall: a plain call's time (calls back to back, the GPU synchronized after the batch);
- host: the CPU time of one call while the GPU is held busy by a queued sleep, so no call waits
  on the GPU (codegen/tuning.host_ms, over HOST_CALLS calls only: CUDA's launch queue holds
  about a thousand kernels, and a full queue blocks the host, which then counts GPU time);
- GPU: CUDA-event time of calls queued behind a sleep, the kernels' own time (tuning.gpu_ms).
A variant whose host time reaches its GPU time is host-bound. Then, for each xaccel variant, the
host time of each xaccel op's dispatch (key, kernel provider and launches: runtime.dispatch timed
around, the GPU kept busy) against the call's whole host time, and xaccel's call beside the eager
rest under the torch profiler: the ops with the most CPU time of their own. Run on the GPU machine:

    python benchmarks/host_cost.py --only "mlstm_paper d1024 NH4 (DH256) S2048 B8 bf16 fwd" [--calls 20]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from torch_xaccel.codegen import tuning
from torch_xaccel.sweep import forms
from torch_xaccel.sweep.run import _make_call

HOST_CALLS = 2


def _times(call, calls: int) -> dict:
    """wall ms per call (median of 5 batches); host and GPU ms per call as the tuner times them."""
    wall = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3 / calls)
    return {"wall": statistics.median(wall), "host": tuning.host_ms(call, calls=HOST_CALLS),
            "gpu": tuning.gpu_ms(call, calls=calls)}


def _variants(row: dict):
    model, inputs = forms.build(row, "cuda")
    out = {"eager": (model, model)}
    m = copy.deepcopy(model)
    out["inductor"] = (m, torch.compile(m))
    m = copy.deepcopy(model)
    out["xaccel (default)"] = (m, torch.compile(m, backend="xaccel"))
    for rest in ("eager", "inductor"):
        m = copy.deepcopy(model)
        out[f"xaccel ({rest} rest)"] = (m, torch.compile(m, backend="xaccel",
                                                        options={"xaccel.choose": False, "xaccel.fallback": rest}))
    return out, inputs


def _host_by_op(call, calls: int) -> tuple[float, dict]:
    """(host ms per call, {op: (dispatches per call, host us per dispatch)}) with the GPU held busy
    by a queued sleep, so no launch waits on the device. runtime.dispatch is wrapped for the
    measurement: what it times is the op's whole kernel path (case key, provider, launches), not
    the dispatcher's or a compiled graph's way to it."""
    from torch_xaccel import runtime

    spent: dict = {}
    plain = runtime.dispatch

    def timed(op, *args):
        t0 = time.perf_counter()
        try:
            return plain(op, *args)
        finally:
            n, s = spent.get(op, (0, 0.0))
            spent[op] = (n + 1, s + time.perf_counter() - t0)
    call()
    runtime.dispatch = timed
    try:
        call()
        torch.cuda.synchronize()
        spent.clear()
        torch.cuda._sleep(20_000_000)
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        host = (time.perf_counter() - t0) * 1e3 / calls
        torch.cuda.synchronize()
    finally:
        runtime.dispatch = plain
    return host, {op: (n / calls, s * 1e6 / n) for op, (n, s) in spent.items()}


def _by_op_table(name: str, host: float, by_op: dict) -> str:
    rows = [f"\n{name}: host {host:.3f} ms per call, of which xaccel ops' dispatch "
            f"{sum(n * us for n, us in by_op.values()) / 1e3:.3f} ms\n",
            "| op | calls per call | host us per dispatch |", "| --- | ---: | ---: |"]
    by_total = sorted(by_op.items(), key=lambda kv: -kv[1][0] * kv[1][1])
    rows += [f"| {op} | {n:g} | {us:.0f} |" for op, (n, us) in by_total]
    return "\n".join(rows)


def _profile(call, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", required=True, help="rows whose label contains this text ('a|b': either)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    import torch_xaccel  # noqa: F401 - registers the backend where no entry point is installed

    wanted = args.only.split("|")
    rows = [r for r in forms.grid() if any(w in forms.label(r) for w in wanted)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, commit {os.environ.get('XACCEL_COMMIT', '?')}")
    for row in rows:
        row = {**row, "device": "cuda"}
        print(f"\n## {forms.label(row)}\n\n| variant | wall ms | host ms | GPU ms | host / GPU |\n"
              "| --- | ---: | ---: | ---: | ---: |")
        variants, inputs = _variants(row)
        calls = {}
        for name, (module, fn) in variants.items():
            call = calls[name] = _make_call(row, module, fn, inputs)
            try:
                for _ in range(3):
                    call()
                t = _times(call, args.calls)
                print(f"| {name} | {t['wall']:.3f} | {t['host']:.3f} | {t['gpu']:.3f} | {t['host'] / t['gpu']:.2f} |",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a finding
                print(f"| {name} | failed: {type(e).__name__}: {str(e)[:120]} | | | |", flush=True)
        for name, call in calls.items():
            if name.startswith("xaccel"):
                try:
                    print(_by_op_table(name, *_host_by_op(call, HOST_CALLS)), flush=True)
                except Exception as e:  # noqa: BLE001 - a variant that fails is a finding
                    print(f"{name}: by op failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        print(f"\nxaccel (eager rest), CPU time by op:\n```\n{_profile(calls['xaccel (eager rest)'], args.top)}\n```")
        variants = calls = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
