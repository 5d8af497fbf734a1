"""What every bench suite shares: the Case a suite lists, the timing (median of do_bench, the GPU
heated first, CUDA-graph replays), run_case (eager against torch.compile) and the table, plot and
tuning report a run writes. No family here: each suite's cases live in its own module."""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from torch_xaccel.codegen import tuning


@dataclass
class Case:
    name: str
    flop: float
    make: Callable  # () -> (fn, args, cublas_only_fn)
    train: bool = False
    # case -> rows, the suite's own runner (op-level kernels and their anchors, whole models); None:
    # run_case, eager against torch.compile (xaccel, Inductor) and the baseline
    runner: Callable | None = None
    graphs: bool = False  # also time CUDA-graph replays (decode shapes: CPU launch cost hidden)
    baseline: str = "cuBLAS matmuls alone"  # what make()'s third function times: the case's floor
    rows: list = field(default_factory=list)
    # () -> a function naming the kernels that the compiles since this call picked, for run_case's
    # xaccel row: a family's own tuning record, which this shared module does not import
    kernels: Callable | None = None


# do_bench's warmup and rep are milliseconds, not calls: budgets long enough that even a whole-model
# train step gets several warm-up and timed calls (a median over more than one; tests/test_bench.py)
BENCH_WARMUP_MS = {True: 300, False: 50}
BENCH_REP_MS = {True: 1000, False: 300}


def _ratios_to_first(rows: list) -> list:
    """rows with both ratio columns set to each row's time over the first row's (the runners whose
    first row is their reference)."""
    base = rows[0]["ms"] if rows else 1.0
    for r in rows:
        r["vs_cublas"], r["vs_xaccel"] = r["ms"] / base, r["ms"] / base
    return rows


def _bench(fn, train: bool, grad_to_none=None) -> float:
    """Median ms per call of fn (triton.testing.do_bench, L2 flushed before each call)."""
    return _bench_calls(fn, train, grad_to_none)[0]


def _bench_calls(fn, train: bool, grad_to_none=None) -> tuple[float, list]:
    """(median, every timed call's ms): the model rows print the spread beside the median."""
    if not torch.cuda.is_available():  # CPU smoke runs (`model --quick`): the code path, not a timing
        fn()
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, [ms]
    import triton.testing

    calls = triton.testing.do_bench(fn, warmup=BENCH_WARMUP_MS[train], rep=BENCH_REP_MS[train], return_mode="all",
                                    grad_to_none=grad_to_none)
    calls = calls.tolist() if hasattr(calls, "tolist") else calls  # a list, or a tensor in some Triton versions
    calls = [float(c) for c in calls] if isinstance(calls, (list, tuple)) else [float(calls)]
    return statistics.median(calls), calls


HEAT_S = 2.0


def _heat(fn, seconds: float = HEAT_S) -> None:
    """Run fn for `seconds` before the first timing of a case. An idle GPU boosts its clocks for
    the first GEMMs and throttles under sustained load: a row timed first, cold, would run faster
    than the rows after it and skew every ratio against them."""
    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()


def _graphed(fn):
    """fn captured in a CUDA graph after warm-up calls on a side stream: returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()



# --paths: a regular expression; the model and sLSTM-stack suites run only the rows whose label it
# finds. Set by the CLI, read at run time as common.PATHS (one variable, whichever module reads it)
PATHS = ""


GPU_TIME_NOTE = "GPU time of 20 calls queued behind a GPU sleep: no L2 flush between calls, CPU launch cost hidden"


def run_case(case: Case, max_autotune: bool) -> list:
    import torch._dynamo

    made = case.make()
    fn, args, cublas = made[:3]
    step = made[3] if case.train else (lambda f: (lambda: f(*args)))
    rows = []

    def add(path, ms, extra=""):
        rows.append(dict(case=case.name, path=path, ms=ms, tflops=case.flop / ms / 1e9, extra=extra))
        print(f"  {path:28s} {ms:9.3f} ms  {case.flop / ms / 1e9:7.1f} TFLOP/s  {extra}", flush=True)

    print(f"\n{case.name}", flush=True)
    _heat(cublas)
    add(case.baseline, _bench(cublas, case.train))
    back_to_back = not case.train and not case.graphs and torch.cuda.is_available()
    if back_to_back:  # diagnostic: GPU time alone, to tell kernel time from per-call CPU cost
        add(f"{case.baseline}, back to back", tuning.gpu_ms(cublas), GPU_TIME_NOTE)
    add("eager", _bench(step(fn), case.train))
    paths = [("xaccel", dict(backend="xaccel")), ("inductor default", dict())]
    if max_autotune and not case.train:
        paths.append(("inductor max-autotune", dict(mode="max-autotune-no-cudagraphs")))
    def graphed(fn):
        return _graphed(lambda: fn(*args))

    if case.graphs:
        add("eager, CUDA graph", _bench(graphed(fn), False))
    for path, kw in paths:
        torch._dynamo.reset()
        picked = case.kernels() if case.kernels else None
        try:
            compiled = torch.compile(fn, **kw)
            t0 = time.perf_counter()
            step(compiled)()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            extra = f"first call {compile_s:.1f}s"
            if path == "xaccel" and not case.train:
                with torch.no_grad():
                    ref = fn(*[a.float() for a in args])
                    extra += f", rel err vs fp32 {_rel(compiled(*args), ref):.1e}"
            if path == "xaccel":
                from torch_xaccel.report import last_report
                extra += f", replaced {({k: v for k, v in last_report(1).counts().items() if v}) or 'nothing'}"
                if picked:
                    extra += f", kernels: {picked()}"
            add(path, _bench(step(compiled), case.train), extra)
            if back_to_back and path == "xaccel":
                add("xaccel, back to back", tuning.gpu_ms(step(compiled)), GPU_TIME_NOTE)
            if case.graphs and path == "xaccel":
                add("xaccel, CUDA graph", _bench(graphed(compiled), False))
        except Exception as e:  # noqa: BLE001 - a failing path is a finding, not a crash
            print(f"  {path:28s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    if not case.graphs:  # the first row again, after everything else: how far the clocks moved meanwhile
        add(f"{case.baseline}, again", _bench(cublas, case.train), "measured last, as a check of the first row")
    base = rows[0]["ms"]
    xa = next((r["ms"] for r in rows if r["path"] == "xaccel"), None)
    for r in rows:
        r["vs_cublas"] = r["ms"] / base
        r["vs_xaccel"] = r["ms"] / xa if xa else None
    return rows


def markdown(rows, header: str) -> str:
    out = [header, "", "| case | path | ms | TFLOP/s (GB/s of floor for mLSTM) | x first row | x xaccel | notes |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        vx = f"{r['vs_xaccel']:.2f}" if r["vs_xaccel"] else "-"
        out.append(f"| {r['case']} | {r['path']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['vs_cublas']:.3f} | {vx} "
                   f"| {r['extra']} |")
    return "\n".join(out) + "\n"


def plot(rows, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    cases = list(dict.fromkeys(r["case"] for r in rows))
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4 + 0.4 * len(cases)))
    width = 0.8 / len(paths)
    for i, p in enumerate(paths):
        ys = [next((r["vs_cublas"] for r in rows if r["case"] == c and r["path"] == p), 0) for c in cases]
        ax.barh([j + i * width for j in range(len(cases))], ys, height=width, label=p)
    ax.set_yticks([j + 0.4 - width / 2 for j in range(len(cases))], [c[:48] for c in cases], fontsize=8)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("time / cuBLAS matmuls alone (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)



def tuning_report(since: float) -> str:
    """Every tuning decision written since `since`: each candidate's time (or why it was
    skipped), so a benchmark run also says which kernel variant won and by how much."""
    from torch_xaccel.codegen import cache

    lines = []
    for path in sorted((cache.root() / "tuning").glob("*.json"), key=os.path.getmtime):
        if os.path.getmtime(path) < since:
            continue
        try:
            data = json.loads(path.read_text())
            key, value = data["key"], data["value"]
            rows = [f"  - {why}" if cfg == "decided by"
                    else f"  - {ms if ms is not None else 'skipped'} ms  {cfg}  {why}".rstrip()
                    for cfg, ms, why in value.get("timings", [])]
            lines += [f"- `{key.split('|torch')[0]}` -> {value.get('config')}", *rows]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # not a tuning entry this report can read
    return "tuning decisions of this run:\n" + "\n".join(lines) if lines else ""
