"""What the backend did with each graph: replacements, fallbacks with reasons, graph breaks, errors."""
from __future__ import annotations

import contextlib
import logging
import textwrap
import time
from collections import deque
from dataclasses import dataclass, field

from . import logs
from .families import REPORT_KEYS


@dataclass(frozen=True)
class Replacement:
    family: str
    op: str
    pattern: str
    location: str = ""
    note: str = ""  # e.g. where the chain stopped and why


@dataclass(frozen=True)
class Fallback:
    family: str  # a pattern family, "graph_break" or "backend"
    reason: str
    location: str = ""


@dataclass
class GraphReport:
    """One Dynamo graph's compile. Once published, a choice made later (the measured choice decides
    at the graph's first call, after the compile) is logged as it is set (logs.py)."""
    index: int
    replacements: list[Replacement] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    disabled: bool = False
    fallback_backend: str = "eager"
    patterns: tuple[str, ...] = ()
    eager_pointwise: int = 0  # pointwise ATen ops left outside the replaced patterns
    plain_decode_steps: int = 0  # decode-step ops of a CUDA graph module compiled without CUDA graphs
    settings: str = ""  # torch.compile's mode=/options= as applied, for the report (modes.describe)
    generation: int = 0  # Dynamo's reset generation it was compiled in (last_report drops older ones)
    chosen: str = ""  # the candidate that runs the graph (choice.py), once chosen
    choice: str = ""  # the report's line for it: the candidate and the times that chose it
    region_choices: list = field(default_factory=list)  # per kind of region: kept or put back, and the times
    # where the first call's time went: phase -> seconds, in order (the compile's trace, passes, region
    # measurements and candidate builds; the measurement at the graph's first call)
    compile_s: dict = field(default_factory=dict)
    force_log: bool = field(default=False, repr=False, compare=False)  # XACCEL_LOG: logged whatever TORCH_LOGS says
    published: bool = field(default=False, repr=False, compare=False)

    @contextlib.contextmanager
    def timing(self, phase: str):
        """Adds the block's wall time to compile_s[phase]."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - t0
            self.compile_s[phase] = self.compile_s.get(phase, 0.0) + took
            # as each phase ends (TORCH_LOGS="+xaccel"): a first call cut short still says how far it got
            logs.log.debug("graph %d: %s took %.2f s", self.index, phase, took)

    def compile_line(self) -> str:
        """'trace 0.41 s, passes 0.20 s, ...' (phases under 5 ms left out)."""
        return ", ".join(f"{k} {v:.2f} s" for k, v in self.compile_s.items() if v >= 0.005)

    def __setattr__(self, name, value) -> None:
        object.__setattr__(self, name, value)
        if name == "choice" and value and getattr(self, "published", False):
            logs.info("graph %d: %s", self.index, value, force=self.force_log)


POINTWISE_HINT = 16  # from this many eager pointwise ops on, the report suggests Inductor for the rest


@dataclass
class Report:
    graphs: list[GraphReport] = field(default_factory=list)
    graph_breaks: list[Fallback] = field(default_factory=list)
    runtime_fallbacks: list = field(default_factory=list)
    kernel_choices: list = field(default_factory=list)  # (op, case, what runs), filled by explain()

    @property
    def replacements(self) -> list[Replacement]:
        return [r for g in self.graphs for r in g.replacements]

    @property
    def fallbacks(self) -> list[Fallback]:
        """Everything not replaced, with the reason: pattern refusals, backend errors, graph breaks."""
        return [f for g in self.graphs for f in g.fallbacks] + list(self.graph_breaks)

    def counts(self) -> dict[str, int]:
        out = {f: 0 for f in REPORT_KEYS}
        for r in self.replacements:
            out[r.family] = out.get(r.family, 0) + 1
        return out

    def __str__(self) -> str:
        lines = [f"torch_xaccel report: {len(self.graphs)} graph(s), {len(self.graph_breaks)} graph break(s)"]
        if any(g.disabled for g in self.graphs):
            lines.append("  disabled (XACCEL_DISABLE=1 or xaccel.disable): graphs ran as captured, nothing replaced")
        counts = ", ".join(f"{k}={v}" for k, v in self.counts().items())
        lines.append(f"  replaced: {counts}")
        lines += [f"  {s}" for s in dict.fromkeys(g.settings for g in self.graphs if g.settings)]
        for g in self.graphs:
            lines += [f"  graph {g.index} region {line}" for line in g.region_choices]
            lines += [f"  graph {g.index}: {g.choice}"] if g.choice else []
            lines += [f"  graph {g.index} first call: {g.compile_line()}"] if g.compile_line() else []
        left = sum(g.eager_pointwise for g in self.graphs
                   if g.fallback_backend == "eager" or g.chosen == "xaccel (eager rest)")
        if left >= POINTWISE_HINT:
            lines.append(f"  hint: {left} pointwise ops outside the replaced patterns run eagerly, one kernel each; "
                         "XACCEL_FALLBACK=inductor fuses them (faster steps, a longer compile; docs/benchmarks.md)")
        steps = sum(g.plain_decode_steps for g in self.graphs)
        if steps:
            lines.append(f"  hint: {steps} decode-step op(s) run on CUDA outside a CUDA graph; a one-token step is "
                         "bound by host time there and can be slower than the uncompiled model: replay it from a "
                         "CUDA graph (mode=\"reduce-overhead\", or a captured step; docs/benchmarks.md)")
        rows = [("replaced", r.family, r.pattern + (f"  [{r.note}]" if r.note else ""), r.location)
                for r in self.replacements]
        rows += [("fallback", f.family, f.reason, f.location) for f in self.fallbacks]
        rows += [("runtime", e.op, f"{e.reason} [kernel {e.provider.rsplit('.', 1)[-1]}]", e.key[:40])
                 for e in self.runtime_fallbacks]
        rows += [("kernel", op, f"{case} -> {choice}", "") for op, case, choice in sorted(self.kernel_choices)]
        if rows:
            head = ("what", "family", "detail", "where")
            widths = [min(max(len(str(r[i])) for r in rows + [head]), 70) for i in range(3)]

            def fmt(r):  # long details wrap onto continuation lines instead of being cut
                parts = textwrap.wrap(str(r[2]), widths[2]) or [""]
                first = ("  " + "  ".join(str(c).ljust(w) for c, w in zip((r[0], r[1], parts[0]), widths))
                         + "  " + str(r[3]))
                pad = " " * (widths[0] + widths[1] + 6)
                return [first] + [pad + p for p in parts[1:]]

            lines += fmt(head) + ["  " + "-" * (sum(widths) + 12)] + [ln for r in rows for ln in fmt(r)]
        return "\n".join(lines)


# Every compile's GraphReport goes to the recent list and to each active collector (explain()).
RECENT: deque[GraphReport] = deque(maxlen=64)
_COLLECTORS: list[list[GraphReport]] = []
_counter = 0
_generation = 0


def _reset_marker(*args, **kwargs) -> None:
    """A no-op Dynamo compile-start callback: torch._dynamo.reset() clears every callback, so
    while this one is registered no reset has happened since it was."""


def _dynamo_generation(after_compile: bool) -> int:
    """Counts torch._dynamo.reset() calls seen: after_compile (a graph was just compiled) starts a
    new generation when a reset happened since the last one; otherwise a reset since the last
    compile makes every kept graph stale (the generation past the current one)."""
    global _generation
    try:
        from torch._dynamo.callback import callback_handler
        registered = _reset_marker in callback_handler.start_callbacks
    except (ImportError, AttributeError):  # a torch without compile callbacks: nothing is dropped
        return _generation
    if registered:
        return _generation
    if not after_compile:
        return _generation + 1
    _generation += 1
    callback_handler.register_start_callback(_reset_marker)
    return _generation


def new_graph_report() -> GraphReport:
    global _counter
    _counter += 1
    return GraphReport(index=_counter)


def publish(report: GraphReport) -> None:
    """Keep the compile's report (last_report, explain's collectors) and log it at INFO."""
    report.generation = _dynamo_generation(after_compile=True)
    RECENT.append(report)
    for c in _COLLECTORS:
        c.append(report)
    report.published = True
    if report.force_log or logs.log.isEnabledFor(logging.INFO):  # (formatted now: the report changes later)
        logs.info("%s", str(Report(graphs=[report])), force=report.force_log)


@contextlib.contextmanager
def collect():
    sink: list[GraphReport] = []
    _COLLECTORS.append(sink)
    try:
        yield sink
    finally:
        _COLLECTORS.remove(sink)


def last_report(n_graphs: int | None = None) -> Report:
    """Report over the most recent compiles (all kept ones by default) since the last
    torch._dynamo.reset(): graphs compiled before a reset no longer run."""
    generation = _dynamo_generation(after_compile=False)
    graphs = [g for g in RECENT if g.generation == generation]
    return Report(graphs=graphs[-n_graphs:] if n_graphs else graphs)
