"""The one tuner every family uses: tuning keys, the rules for when to time, stored decisions,
candidate timing with a progress bar, and the GPU / host timers.

A family describes one tuning problem (its candidates, how to time one, when a stored decision
still holds) and calls `decide`; what is the same for every family lives here:
- the key: the family's own parts plus the GPU, torch and Triton versions, the family's template
  digest and VERSION, so a decision is never reused for other code or another machine;
- no timing under Triton's interpreter (the family's untimed choice runs), inside a CUDA-graph
  capture (a stored decision, else the untimed choice, and nothing is remembered: a later
  uncaptured call tunes) or with XACCEL_TUNE=0 (a stored decision, else the untimed choice);
- otherwise the stored decision, or a timing run under the key's lock across processes, stored.

`PlainCalls` applies the same rules to one more question a small op asks: which of its kernel and
its ATen reference costs less per call when the call runs plainly, outside a CUDA graph.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from torch_xaccel import config, logs, runtime
from torch_xaccel.runtime import interpreting

from . import cache

PLAIN_SMALL_ELEMENTS = 1 << 17  # a case this small may be host-bound when called plainly (PlainCalls)
VERSION = 7  # part of every tuning key: bump when candidate lists or timing methods change


def key(family: str, parts: str, device: torch.device, template_digest: str) -> str:
    return f"{family}|{parts}|{_machine(device)}|tpl{template_digest}|tv{VERSION}"


@functools.lru_cache(maxsize=None)
def _machine(device: torch.device) -> str:
    """The GPU and versions part of every key: built once per device, since families build keys
    on their calls' hot path."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # a CPU install without Triton: the graph choice still keys on the machine
        triton_version = "none"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{gpu}|torch{torch.__version__}|triton{triton_version}"


@dataclass(frozen=True)
class Decision:
    config: object  # as stored (JSON: a list or a dict), or the untimed choice
    entry: dict = field(default_factory=dict)  # the stored entry: timings, pending builds, notes
    live: bool = False  # tuning was allowed: the entry's pending work (e.g. CUTLASS builds) counts


_TRIAL = contextvars.ContextVar("xaccel_trial", default=False)


@contextlib.contextmanager
def trial():
    """Ops run to decide whether they stay in the graph at all (choice.py measuring a region):
    kernels tune as usual, but background work that pays off only for an op that stays (CUTLASS
    builds) waits for the op's next call outside a trial. A replacement put back then leaves no
    nvcc processes competing with the rest of the compile and the model's own calls."""
    token = _TRIAL.set(True)
    try:
        yield
    finally:
        _TRIAL.reset(token)


def in_trial() -> bool:
    return _TRIAL.get()


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def decide(key: str, *, untimed, valid, tune, usable=None, memo: dict | None = None) -> Decision:
    """The decision for `key`. valid(entry): a stored entry still holds (else it is tuned again);
    tune() -> entry times the candidates ({"config": ..., "timings": [...], ...}); usable(entry)
    (default: valid): a stored entry may serve when nothing may be timed; untimed: the config
    to run then. memo: a dict remembering decisions in this process, keyed by `key`."""
    if memo is not None and key in memo:
        return memo[key]
    if interpreting():
        return Decision(untimed)
    usable = usable or valid
    live = config.current().tune
    in_capture = capturing()
    if in_capture or not live:
        stored = cache.read_entry("tuning", key)
        decision = Decision(stored["config"], stored) if usable(stored) else Decision(untimed)
        if memo is not None and not in_capture:
            memo[key] = decision
        return decision
    entry = cache.read_entry("tuning", key)
    if not valid(entry):
        with cache.locked(cache.key_name(key)):
            entry = cache.read_entry("tuning", key)  # another process may have finished meanwhile
            if not valid(entry):
                t0 = time.perf_counter()
                entry = tune()
                cache.write_entry("tuning", key, entry)
                # (TORCH_LOGS=+xaccel: which tunings a first call spends its time on)
                logs.log.debug("tuned %s in %.2f s", key.split("|tpl")[0], time.perf_counter() - t0)
    decision = Decision(entry["config"], entry, live=True)
    if memo is not None:
        memo[key] = decision
    return decision


def precompile(cands, warmup) -> None:
    """Compile every candidate at once before they are timed: warmup(cfg) runs Triton's warmup
    (compile, no launch) under triton.AsyncCompileMode on XACCEL_COMPILE_THREADS threads (the
    compiler drops the GIL for most of its work). Best effort: a config that fails here is
    compiled again, and skipped with its error, when timed."""
    import triton

    mode = getattr(triton, "AsyncCompileMode", None)
    workers = min(len(cands), os.cpu_count() or 1, config.current().compile_threads)
    if mode is None or workers < 2:
        return
    from concurrent.futures import ThreadPoolExecutor

    active = getattr(getattr(getattr(triton, "runtime", None), "_async_compile", None), "active_mode", None)
    token = active.set(None) if active is not None else None
    try:
        with ThreadPoolExecutor(workers) as pool, mode(pool, ignore_errors=True):
            for cfg in cands:
                try:
                    warmup(cfg)
                except Exception:  # noqa: BLE001 - compiled (or reported) again when timed
                    pass
    except Exception:  # noqa: BLE001 - parallel compilation is an optimisation only
        pass
    finally:
        if token is not None:  # Triton 3.6 leaves the mode set if its exit raises: later compiles must not see it
            active.reset(token)


def fastest(label: str, cands, bench, best=None, best_ms: float = float("inf"), timings: list | None = None):
    """The candidate with the lowest bench(cfg) (ms) below best_ms, else `best`; a candidate whose
    bench raises (does not build, fit or agree) is skipped. A progress bar after two seconds.
    `timings` (a list) receives [cfg, ms or None, why skipped] per candidate, for the tuning entry:
    the report of what was tried."""
    progress = Progress(f"tuning {label}", len(cands))
    for n, cfg in enumerate(cands):
        why = ""
        try:
            ms = bench(cfg)
        except Exception as e:  # noqa: BLE001 - a config that does not build, fit or agree is not a candidate
            ms, why = float("inf"), f"{type(e).__name__}: {str(e)[:160]}"
        if timings is not None:
            timings.append([cfg, round(ms, 5) if ms < float("inf") else None, why])
        if ms < best_ms:
            best, best_ms = cfg, ms
        progress.step(n + 1)
    progress.close()
    return best


class Progress:
    """A one-line progress bar on stderr, shown once the work has taken over two seconds."""

    def __init__(self, label: str, total: int, show_after_s: float = 2.0):
        self.label, self.total, self.t0, self.shown = label, total, time.perf_counter(), False
        self.show_after_s = show_after_s

    def step(self, done: int) -> None:
        if time.perf_counter() - self.t0 < self.show_after_s and not self.shown:
            return
        self.shown = True
        bar = "#" * int(20 * done / self.total)
        sys.stderr.write(f"\r[xaccel] {self.label} [{bar:<20}] {done}/{self.total}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write(f"  {time.perf_counter() - self.t0:.1f}s\n")


def bench_ms(fn, warmup: int = 5, rep: int = 20) -> float:
    """Median ms of fn in triton.testing.do_bench's short bursts (L2 flushed between calls)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def gpu_ms(fn, calls: int = 20, rounds: int = 3) -> float:
    """GPU milliseconds per call of fn, without its CPU launch cost and without a graph capture
    (which would disturb other threads and, if it failed, the caching allocator): a GPU sleep
    longer than the CPU needs to queue `calls` calls is enqueued first, so the events around them
    time only the GPU's work. The sleep is four times a first, plain round's queueing time, a
    margin for a host whose speed varies from one moment to the next (a shorter sleep lets host
    time leak into the figure). Median of `rounds`."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    queue_ms = (time.perf_counter() - t0) * 1e3  # an upper bound of the CPU's queueing time
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles = int(10_000_000 * 4 * queue_ms / max(start.elapsed_time(end), 1e-3)) + 1_000_000
    results = []
    for _ in range(rounds):
        torch.cuda._sleep(cycles)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        results.append(start.elapsed_time(end) / calls)
    return sorted(results)[len(results) // 2]


def host_ms(fn, calls: int = 20, rounds: int = 3) -> float:
    """CPU milliseconds per call of fn with the GPU kept busy ahead of it (a queued sleep), so
    that no launch waits on the device: what an uncaptured decode call costs the host. Median
    of `rounds`."""
    fn()
    torch.cuda.synchronize()
    results = []
    for _ in range(rounds):
        torch.cuda._sleep(20_000_000)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        results.append((time.perf_counter() - t0) * 1e3 / calls)
        torch.cuda.synchronize()
    return sorted(results)[len(results) // 2]


def wall_ms(fn, calls: int = 20, rounds: int = 3) -> float:
    """ms per call of fn called back to back and waited for: host and GPU time together, whichever
    bounds, as a plain (uncaptured) call in a loop pays them. Median of `rounds`."""
    fn()
    torch.cuda.synchronize()
    results = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        results.append((time.perf_counter() - t0) * 1e3 / calls)
    return sorted(results)[len(results) // 2]


class PlainCalls:
    """Whether a small op's plain call runs its ATen reference instead of its kernel.

    Called plainly (outside a CUDA-graph capture), a decode-size case is host-bound: the user pays
    its host and GPU time together, and the reference's few ATen calls can cost the host less than
    the kernel's launch path, while inside a capture only GPU time counts and the kernel wins. So
    the first plain call of a case up to PLAIN_SMALL_ELEMENTS times both back to back (wall_ms),
    under `decide`'s rules (stored per machine and versions, untimed: the kernel), and the faster
    serves that case's plain calls; a captured call always runs the kernel. Where the reference
    serves without having been timed here, the kernel still runs once at that first call, so that
    it is compiled before a capture launches it."""

    def __init__(self, family: str, op: str, digest: str):
        self.family, self.op, self.digest, self.memo = family, op, digest, {}

    def reference_runs(self, case_key, numel: int, device: torch.device, case, kernel, reference) -> bool:
        """case_key: the dispatch's key; case(): its label for tuning keys and reports (called once
        per case); kernel() and reference(): one call of each on the case's real arguments."""
        if numel > PLAIN_SMALL_ELEMENTS or capturing():
            return False
        runs = self.memo.get(case_key)
        if runs is None:
            runs = self.memo[case_key] = self._decide(case_key, device, case, kernel, reference)
        if runs:
            runtime.note_use(case_key)
        return runs

    def _decide(self, case_key, device, case, kernel, reference) -> bool:
        timed, case = [], case()

        def tune():
            kernel_ms, aten_ms = wall_ms(kernel), wall_ms(reference)
            timed.append(True)
            return {"config": "aten" if aten_ms < kernel_ms else "kernel",
                    "timings": [["kernel", round(kernel_ms, 5), "per plain call"],
                                ["aten", round(aten_ms, 5), "per plain call"]]}

        decision = decide(key(self.family, f"plain|{self.op}|{case}", device, self.digest), untimed="kernel",
                          valid=lambda e: isinstance(e, dict) and e.get("config") in ("kernel", "aten"), tune=tune)
        if decision.config != "aten":
            return False
        if not timed:
            kernel()  # compiled now: a later capture launches it
        ms = {name: t for name, t, _ in decision.entry.get("timings", [])}
        runtime.record_choice(case_key, self.op, case, "ATen reference when called plainly (host-bound: "
                              f"{_us(ms.get('aten'))} per call against the kernel's {_us(ms.get('kernel'))}), "
                              "the kernel inside CUDA graphs")
        return True


def _us(ms) -> str:
    return "?" if ms is None else f"{ms * 1e3:.0f} us"
