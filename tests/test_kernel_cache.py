"""The on-disk cache: corrupt or foreign entries are ignored, writers never leave half files,
and concurrent processes tuning one key wait for each other."""
import json
import multiprocessing
import os
import time

import pytest
import torch

from torch_xaccel.codegen import cache, tuning


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_round_trip():
    cache.write_entry("tuning", "k1", {"config": [1, 2]})
    assert cache.read_entry("tuning", "k1") == {"config": [1, 2]}
    assert cache.read_entry("tuning", "missing") is None


def test_corrupt_entry_is_ignored(tmp_path):
    cache.write_entry("tuning", "k1", {"config": [1]})
    path = tmp_path / "tuning" / f"{cache.key_name('k1')}.json"
    path.write_text('{"key": "k1", "val')  # torn write
    assert cache.read_entry("tuning", "k1") is None
    path.write_text("[1, 2, 3]")
    assert cache.read_entry("tuning", "k1") is None


def test_foreign_entry_is_ignored(tmp_path):
    path = tmp_path / "tuning" / f"{cache.key_name('k1')}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": "another key with a colliding file name", "value": {"config": [9]}}))
    assert cache.read_entry("tuning", "k1") is None


def _tune_once(root, log):
    os.environ["XACCEL_CACHE_DIR"] = root
    with cache.locked("shared-key"):
        if cache.read_entry("tuning", "shared-key") is None:
            with open(log, "a") as fh:
                fh.write("tuned\n")
            time.sleep(0.3)  # a slow tuning run: the other process must wait, then reuse it
            cache.write_entry("tuning", "shared-key", {"config": [os.getpid()]})
    return cache.read_entry("tuning", "shared-key")


def test_concurrent_processes_tune_once(tmp_path):
    log = tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        results = pool.starmap(_tune_once, [(str(tmp_path), str(log))] * 3)
    assert log.read_text().count("tuned") == 1
    assert all(r == results[0] for r in results)
    assert not list((tmp_path / "tuning").glob("*.tmp"))


def test_fastest_records_every_candidate_and_skips_failures():
    def bench(cfg):
        if cfg == "broken":
            raise RuntimeError("out of shared memory")
        return {"a": 2.0, "b": 1.0}[cfg]
    timings = []
    assert tuning.fastest("t", ["a", "broken", "b"], bench, timings=timings) == "b"
    assert [t[:2] for t in timings] == [["a", 2.0], ["broken", None], ["b", 1.0]]
    assert "out of shared memory" in timings[1][2]
    # nothing beats the incumbent: it stays
    assert tuning.fastest("t", ["a", "b"], bench, best="aten", best_ms=0.5) == "aten"


def test_bench_tuning_report_lists_this_runs_decisions():
    from torch_xaccel.bench.common import tuning_report

    since = time.time() - 1
    cache.write_entry("tuning", "mlstm_fwd|bf16|torchX", {"config": {"L": 64}, "timings": [[{"L": 64}, 1.5, ""],
                                                                                          [{"L": 128}, None, "OOR"]]})
    cache.write_entry("tuning", "gemm_epilogue|k|M~16|torchX", {"config": ["ptr", 16], "timings": [
        ["aten", 0.012, "GPU time"], [["ptr", 16], 0.015, ""],
        ["decided by", None, "chosen on GPU + host time per call"]]})
    report = tuning_report(since)
    assert "`mlstm_fwd|bf16` -> {'L': 64}" in report and "1.5 ms" in report and "skipped" in report
    assert "  - chosen on GPU + host time per call" in report.splitlines()  # a note, not a skipped config
    assert tuning_report(time.time() + 10) == ""


def test_precompile_warms_every_candidate_and_never_raises(monkeypatch):
    """The parallel compile before tuning is best effort: every candidate is handed to the
    warmup, one that fails does not stop the others, and nothing escapes."""
    import triton

    entered = []

    class Mode:  # stands in for triton.AsyncCompileMode (a real one needs a GPU driver)
        def __init__(self, pool, ignore_errors):
            entered.append(ignore_errors)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(triton, "AsyncCompileMode", Mode, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    warmed = []

    def warmup(cfg):
        warmed.append(cfg)
        if cfg == "b":
            raise RuntimeError("does not compile")
    tuning.precompile(["a", "b", "c"], warmup)
    assert warmed == ["a", "b", "c"] and entered == [True]
    tuning.precompile(["a"], warmup)  # one candidate: nothing to overlap, no pool
    monkeypatch.setenv("XACCEL_COMPILE_THREADS", "1")  # the user's switch: one after another
    tuning.precompile(["a", "c"], warmup)
    assert warmed == ["a", "b", "c"]


def _plain_case(monkeypatch, kernel_ms: float, aten_ms: float):
    """A PlainCalls with stand-in paths whose plain call costs are `kernel_ms` and `aten_ms`
    (wall_ms needs a GPU; here it reads the costs), counting each path's runs."""
    runs = {"kernel": 0, "aten": 0}

    def path(name):
        def fn():
            runs[name] += 1
        fn.cost = kernel_ms if name == "kernel" else aten_ms
        return fn
    kernel, reference = path("kernel"), path("aten")
    monkeypatch.setattr(tuning, "wall_ms", lambda fn: (fn(), fn.cost)[1])
    monkeypatch.setattr(tuning, "capturing", lambda: False)
    return tuning.PlainCalls("fam", "op", "digest"), kernel, reference, runs


def test_plain_calls_run_the_reference_where_it_costs_less_per_plain_call(monkeypatch):
    from torch_xaccel import runtime

    plain, kernel, reference, runs = _plain_case(monkeypatch, kernel_ms=0.09, aten_ms=0.03)
    cpu = torch.device("cpu")
    assert plain.reference_runs(("k",), 100, cpu, lambda: "case", kernel, reference)
    assert runs == {"kernel": 1, "aten": 1}  # timed once each
    assert plain.reference_runs(("k",), 100, cpu, lambda: "case", kernel, reference)
    assert runs == {"kernel": 1, "aten": 1}  # remembered, not timed again
    assert "ATen reference when called plainly" in runtime.CHOICES[("k",)][2]
    assert "30 us" in runtime.CHOICES[("k",)][2] and "90 us" in runtime.CHOICES[("k",)][2]
    # a large case, or a call inside a CUDA-graph capture, runs the kernel without timing
    assert not plain.reference_runs(("big",), tuning.PLAIN_SMALL_ELEMENTS + 1, cpu, lambda: "big", kernel, reference)
    monkeypatch.setattr(tuning, "capturing", lambda: True)
    assert not plain.reference_runs(("k",), 100, cpu, lambda: "case", kernel, reference)
    assert runs == {"kernel": 1, "aten": 1}


def test_plain_calls_keep_the_kernel_where_it_costs_less_and_warm_it_for_a_stored_reference(monkeypatch):
    plain, kernel, reference, runs = _plain_case(monkeypatch, kernel_ms=0.02, aten_ms=0.03)
    cpu = torch.device("cpu")
    assert not plain.reference_runs(("k",), 100, cpu, lambda: "fast kernel", kernel, reference)
    # another process finds a stored "aten" decision: it times nothing, and runs the kernel
    # once, so that a capture later finds it compiled
    plain, kernel, reference, runs = _plain_case(monkeypatch, kernel_ms=0.09, aten_ms=0.03)
    assert plain.reference_runs(("k",), 100, cpu, lambda: "slow kernel", kernel, reference)
    fresh, kernel, reference, runs = _plain_case(monkeypatch, kernel_ms=0.09, aten_ms=0.03)
    assert fresh.reference_runs(("k",), 100, cpu, lambda: "slow kernel", kernel, reference)
    assert runs == {"kernel": 1, "aten": 0}
