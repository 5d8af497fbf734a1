"""Where does the whole model's time go?

xLSTMLarge at 7B widths (B4 x 2048 tokens, bf16, native
configuration compiled with backend="xaccel"), prefill and one train step (mode train-loss: the
loss compiled with the model) under the torch profiler, CUDA kernels grouped by kind. Run on the
GPU machine:

    XACCEL_TUNE=0 python benchmarks/model_profile.py [--fallback eager|inductor]
        [--modes prefill,train,train-loss] [--ops] [--gaps] [--tuning]
    python benchmarks/model_profile.py --gemm-floor

XACCEL_TUNE=0 skips first-call tuning (default configs) so the run spends its time profiling, but
then the GEMMs are not the ones a tuned run picks. --gemm-floor times cuBLAS alone on every
nn.Linear of the model at its shape (forward; forward + input and weight gradients), beside the
anchor's prefill and train step in the same process: the time no backend that uses cuBLAS-class
GEMMs can go below. --gaps lists where the GPU sat idle between kernels in one step (wall time
that no kernel accounts for) and what the host was doing then; --tuning prints the run's tuning
decisions."""
from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import torch

KINDS = (("mlstm", ("mlstm",)), ("xaccel gemm", ("gemm_epilogue",)),
         ("cuBLAS gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
         ("triton (inductor)", ("triton_",)), ("norm", ("norm",)), ("softmax / loss", ("softmax", "nll", "cross")),
         ("elementwise / reduce (ATen)", ("elementwise", "reduce", "vectorized")))  # first match wins


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")




def model(mode: str, **kernels):
    """The 7B-width xLSTMLarge, bf16 on CUDA, in its native configuration unless `kernels` says otherwise."""
    from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

    from torch_xaccel.bench.model import NATIVE_KERNELS

    cfg = xLSTMLargeConfig(vocab_size=50304, chunk_size=64, mode=mode, return_last_states=mode == "train",
                           embedding_dim=4096, num_heads=8, num_blocks=4, **{**NATIVE_KERNELS, **kernels})
    torch.manual_seed(0)
    return xLSTMLarge(cfg).to("cuda", torch.bfloat16)


def loss(logits, ids):
    """The benchmark's loss, as a user writes it around the model: fp32 cross-entropy."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())


def step(mode: str, m, fn, ids) -> None:
    """One prefill (inference mode) or train step (zero_grad, forward, fp32 cross-entropy, backward;
    in mode "train-loss" `fn` already returns the loss: model and loss compiled as one function)."""
    if mode == "prefill":
        with torch.inference_mode():
            fn(ids)
        return
    m.zero_grad(set_to_none=True)
    (fn(ids) if mode == "train-loss" else loss(fn(ids)[0], ids)).backward()


def gemm_floor(tokens: int = 4 * 2048) -> None:
    """cuBLAS alone on the model's linear layers (same shapes, bf16), summed per prefill / train step."""
    import triton.testing
    from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

    cfg = xLSTMLargeConfig(vocab_size=50304, embedding_dim=4096, num_heads=8, num_blocks=4)
    with torch.device("meta"):
        shapes = [(mod.in_features, mod.out_features) for mod in xLSTMLarge(cfg).modules()
                  if isinstance(mod, torch.nn.Linear)]
    fwd_ms = train_ms = flop = 0.0
    per_shape = {}
    for K, N in shapes:
        if (K, N) not in per_shape:
            x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
            dy = torch.randn(tokens, N, device="cuda", dtype=torch.bfloat16)
            f = triton.testing.do_bench(lambda: x @ w.t(), warmup=10, rep=50)
            dx = triton.testing.do_bench(lambda: dy @ w, warmup=10, rep=50)
            dw = triton.testing.do_bench(lambda: dy.t() @ x, warmup=10, rep=50)
            per_shape[(K, N)] = (f, dx, dw)
            print(f"  cuBLAS M{tokens} K{K} N{N}: fwd {f:.3f} ms ({2 * tokens * K * N / f / 1e9:.0f} TFLOP/s), "
                  f"dx {dx:.3f}, dw {dw:.3f}", flush=True)
        f, dx, dw = per_shape[(K, N)]
        fwd_ms, train_ms, flop = fwd_ms + f, train_ms + f + dx + dw, flop + 2 * tokens * K * N
    print(f"GEMM floor ({len(shapes)} linear layers, M{tokens}): prefill {fwd_ms:.3f} ms "
          f"({flop / fwd_ms / 1e9:.0f} TFLOP/s), train step {train_ms:.3f} ms "
          f"({3 * flop / train_ms / 1e9:.0f} TFLOP/s); "
          f"{flop / 1e12:.2f} TFLOP per forward", flush=True)
    from torch_xaccel.bench.model import ANCHOR_KERNELS

    for mode in ("prefill", "train"):
        m = model("inference" if mode == "prefill" else "train", **ANCHOR_KERNELS)
        ids = torch.randint(0, 50304, (tokens // 2048, 2048), device="cuda")
        ms = triton.testing.do_bench(lambda: step(mode, m, m, ids), warmup=3, rep=20)
        print(f"anchor (xlstm Triton kernels) {mode}: {ms:.3f} ms", flush=True)


COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat", "aten::fill_",
            "aten::zero_", "aten::add_")


def copy_sources(run, top: int) -> None:
    """--ops: the copy-like ATen ops of one step by GPU time, with their input shapes and the
    innermost Python frames that called them (where the untraced copies and casts come from)."""
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as p:
        run()
        torch.cuda.synchronize()
    rows = [e for e in p.key_averages(group_by_input_shape=True, group_by_stack_n=6)
            if e.key in COPY_OPS and e.device_time_total > 0]
    print(f"  copy-like ATen ops ({sum(e.device_time_total for e in rows) / 1e3:.2f} ms):", flush=True)
    for e in sorted(rows, key=lambda e: -e.device_time_total)[:top]:
        frames = [f for f in (e.stack or []) if "torch/" not in f or "torch_xaccel" in f][:3]
        print(f"    {e.device_time_total / 1e3:7.3f} ms x{e.count:<3d} {e.key} {str(e.input_shapes)[:90]}"
              f"\n        {' <- '.join(frames)[:300]}", flush=True)


SYNCS = ("Synchronize", "cudaMemcpy", "cuMemcpy", "cudaFree", "cudaMalloc", "cuMemAlloc", "cuMemFree")


def idle_gaps(run, top: int, min_us: float = 10.0) -> None:
    """--gaps: the GPU's idle time between kernels over one step, from the profiler's trace. A gap
    whose next kernel was launched after the previous one ended is the host's (a sync, or Python
    slower than the GPU); the host calls that may block (syncs, blocking copies, allocations) are
    counted, and the CPU ops under way at the largest gaps named."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        run()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        p.export_chrome_trace(fh.name)
        with open(fh.name) as trace:
            events = json.load(trace)["traceEvents"]
    report_gaps(events, top, min_us)


def report_gaps(events: list, top: int, min_us: float) -> None:
    """idle_gaps' analysis of a Chrome trace's events (kineto's categories and fields)."""
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launch = {e["args"].get("correlation"): e for e in host if "args" in e}
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    if not gpu:
        print("  gaps: no GPU events in the trace", flush=True)
        return
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    gaps, busy_until = [], gpu[0]["ts"]
    for prev, nxt in zip(gpu, gpu[1:]):
        busy_until = max(busy_until, prev["ts"] + prev["dur"])
        idle = nxt["ts"] - busy_until
        if idle >= min_us:
            issued = launch.get(nxt.get("args", {}).get("correlation"), {}).get("ts")
            gaps.append((idle, busy_until, issued, prev["name"], nxt["name"]))
    blocking = defaultdict(lambda: [0, 0.0])
    for e in host:
        if any(s in e["name"] for s in SYNCS) and "Async" not in e["name"]:
            blocking[e["name"]][0] += 1
            blocking[e["name"]][1] += e["dur"] / 1e3
    print(f"  gaps: GPU span {span / 1e3:.2f} ms, idle {sum(g[0] for g in gaps) / 1e3:.2f} ms in {len(gaps)} gaps "
          f">= {min_us:.0f} us; host-late launches {sum(g[0] for g in gaps if g[2] and g[2] > g[1]) / 1e3:.2f} ms",
          flush=True)
    for name, (n, ms) in sorted(blocking.items(), key=lambda kv: -kv[1][1]):
        print(f"    host call {name}: x{n}, {ms:.3f} ms", flush=True)
    for idle, start, issued, before, after in sorted(gaps, reverse=True)[:top]:
        end = start + idle
        during = sorted((e for e in ops if e["ts"] < end and e["ts"] + e["dur"] > start and e["dur"] < 20 * idle),
                        key=lambda e: -(min(end, e["ts"] + e["dur"]) - max(start, e["ts"])))
        late = (f"launched {issued - start:.0f} us after the GPU went idle" if issued and issued > start
                else "launched in time")
        print(f"    {idle:8.1f} us idle, {late}: {before[:50]} -> {after[:50]}"
              f"\n        host meanwhile: {', '.join(e['name'] for e in during[:4])[:200]}", flush=True)


def profile(mode: str, top: int, ops: bool = False, gaps: bool = False) -> None:
    import torch._dynamo
    from torch.profiler import ProfilerActivity, profile as prof

    torch._dynamo.reset()
    m = model("inference" if mode == "prefill" else "train")
    fn = torch.compile((lambda t: loss(m(t)[0], t)) if mode == "train-loss" else m, backend="xaccel")
    tokens = torch.randint(0, 50304, (4, 2048), device="cuda")
    run = lambda: step(mode, m, fn, tokens)  # noqa: E731
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 5 * 1e3
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    events = [e for e in p.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / 3 / 1e3
    by_kind = defaultdict(float)
    for e in events:
        by_kind[kind(e.key)] += e.device_time_total / 3 / 1e3
    print(f"\n{mode}: first call {first:.1f} s, {wall:.2f} ms per step (wall), GPU kernel time {total:.2f} ms "
          f"(XACCEL_FALLBACK={os.environ.get('XACCEL_FALLBACK', 'eager')})", flush=True)
    for k, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:30s} {ms:8.2f} ms", flush=True)
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"    {e.device_time_total / 3 / 1e3:7.3f} ms  x{e.count // 3:<4d} {e.key[:100]}", flush=True)
    if ops:
        copy_sources(run, top)
    if gaps:
        idle_gaps(run, top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fallback", default=None, help="XACCEL_FALLBACK for this run")
    ap.add_argument("--modes", default="prefill,train")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--ops", action="store_true", help="also the copy-like ATen ops with shapes and callers")
    ap.add_argument("--gaps", action="store_true",
                    help="also the GPU's idle gaps in one step and the host's part in them")
    ap.add_argument("--tuning", action="store_true", help="also the tuning decisions made in this run")
    ap.add_argument("--gemm-floor", action="store_true", help="cuBLAS alone on the model's GEMMs, and the anchor")
    args = ap.parse_args()
    if args.gemm_floor:
        gemm_floor()
        return
    if args.fallback:
        os.environ["XACCEL_FALLBACK"] = args.fallback
    import torch_xaccel  # noqa: F401 - registers the backend and the library substitutions

    torch._dynamo.config.cache_size_limit = 64
    since = time.time()
    for mode in args.modes.split(","):
        try:
            profile(mode, args.top, args.ops, args.gaps)
        except Exception as e:  # noqa: BLE001 - report and go on to the next mode
            print(f"{mode}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    if args.tuning:
        from torch_xaccel.bench.common import tuning_report
        print(tuning_report(since), flush=True)


if __name__ == "__main__":
    main()
