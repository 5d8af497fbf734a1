"""The measured choice: each replaced region, then each compiled graph, runs as whatever measures
fastest.

Users try `torch.compile(model)` first; this backend must never be slower than that, or than not
compiling.

Per region, at compile time (`choose_regions`): each kind of replaced region (regions.py) runs on
the values it reads in the graph's example call, as replaced and as written, eagerly and under
Inductor; where the original is faster beside a rest, it is put back for that rest.

Per graph, at its first call (`Chooser`), the candidates:
- `xaccel (eager rest)`: the remaining replacements, the rest of the graph run eagerly;
- `xaccel (inductor rest)`: the remaining replacements, the rest through Inductor;
- `inductor`: the captured graph through Inductor, with torch.compile's mode and options;
- `eager`: the captured graph as it is.
Each runs on that call's inputs (copies of those the graph writes), as the call runs: the forward,
or in training the forward and the backward. Interleaved rounds time them; the fastest runs from
then on.

Decisions are stored with the kernel tunings (`codegen/tuning.decide`: the same key discipline,
lock, interpreter and XACCEL_TUNE rules); a later process with the same graph, inputs, settings,
machine and package code builds only the stored winner. A candidate that fails to build or run is
dropped, with its error in the report; a failed measurement puts a region back, and runs a graph
under Inductor (else eagerly).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.utils._pytree as pytree

from . import logs

XACCEL_EAGER, XACCEL_INDUCTOR, INDUCTOR, EAGER = "xaccel (eager rest)", "xaccel (inductor rest)", "inductor", "eager"
ANCHORS = (INDUCTOR, EAGER)
ROUNDS_MIN, ROUNDS_MAX = 5, 60  # timed rounds per candidate
MEASURE_S = 1.0  # time spent in timed rounds, at least ROUNDS_MIN of them
ROUND_MS = 1.0  # calls per round: enough that a round takes about this long (timer noise)


def xaccel_candidate(rest: str) -> str:
    return {"eager": XACCEL_EAGER, "inductor": XACCEL_INDUCTOR}[rest]


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """The package's code (every source the lowering, the ops, the kernels and the choice depend
    on): a stored decision is never reused for other code."""
    import torch_xaccel
    from torch_xaccel import codegen, lowering

    h = hashlib.sha256()
    roots = {Path(m.__file__).parent for m in (torch_xaccel, lowering, codegen)}
    from torch_xaccel.codegen.render import CSRC

    roots.add(Path(CSRC))
    for root in sorted(roots):
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".jinja", ".cuh", ".h", ".cu") and path.is_file():
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _describe_value(node: torch.fx.Node, real) -> str:
    """One input's part of the graph's key: what the compiled code specialises on."""
    fake = node.meta.get("example_value", real)
    if isinstance(fake, torch.Tensor):
        shape = tuple(str(s) for s in fake.shape)
        stride = tuple(str(s) for s in fake.stride()) if fake.layout == torch.strided else ()
        concrete = tuple(real.shape) if isinstance(real, torch.Tensor) else ()
        grad = bool(getattr(real, "requires_grad", False))
        return f"T{shape}{stride}{concrete}{fake.dtype}{fake.device}{grad}"
    if isinstance(fake, torch.SymInt | torch.SymFloat | torch.SymBool):
        return f"S{type(fake).__name__}={real!r}"
    return f"{type(real).__name__}={real!r}"[:80]


def graph_key(gm: torch.fx.GraphModule, example_inputs, settings: str, device: torch.device) -> str:
    """The tuning key of one graph's choice: its code and constants, its inputs as compiled, the
    settings that shape the candidates, the machine and the package's code."""
    from torch_xaccel.codegen import tuning

    h = hashlib.sha256(gm.code.encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if isinstance(value, torch.Tensor):
                h.update(f"{node.target}{tuple(value.shape)}{value.dtype}".encode())
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for node, real in zip(placeholders, example_inputs):
        h.update(_describe_value(node, real).encode())
    h.update(settings.encode())
    return tuning.key("choice", h.hexdigest()[:24], device, code_digest())


def device_of(example_inputs) -> torch.device:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return t.device
    return torch.device("cpu")


def stored(key: str) -> dict | None:
    """A stored decision for key that names a candidate, else None (a damaged entry is ignored and
    measured again)."""
    from torch_xaccel.codegen import cache

    entry = cache.read_entry("tuning", key)
    return entry if _valid(entry) else None


def _valid(entry) -> bool:
    return (isinstance(entry, dict) and entry.get("config") in (XACCEL_EAGER, XACCEL_INDUCTOR, INDUCTOR, EAGER)
            and isinstance(entry.get("timings"), list))


@dataclass
class Candidate:
    name: str
    build: Callable[[], Callable]  # () -> the compiled callable (built inside the backend call)
    fn: Callable | None = None
    build_s: float = 0.0
    error: str = ""

    def make(self) -> None:
        t0 = time.perf_counter()
        try:
            self.fn = self.build()
        except Exception as e:  # noqa: BLE001 - a candidate that does not build is not a candidate
            if _restart(e):
                raise
            self.error = f"build failed: {type(e).__name__}: {str(e)[:200]}"
        self.build_s = time.perf_counter() - t0


def _restart(e: Exception) -> bool:
    """Dynamo's own control flow, raised through (the backend's caller retraces)."""
    from torch._dynamo.exc import RestartAnalysis

    return isinstance(e, RestartAnalysis)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Rng:
    """The random-number state before the measurement, put back after it: the user's first call
    draws the numbers it would have drawn without one (dropout masks, Inductor's seeds)."""

    def __init__(self, device: torch.device):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def written_inputs(aten_gm: torch.fx.GraphModule) -> set[int]:
    """The positions of the inputs the graph writes in place (a buffer's running statistics, a
    cache), through any view of them."""
    from torch_xaccel.lowering.graph_utils import mutated_nodes

    written = mutated_nodes(aten_gm.graph)
    return {i for i, node in enumerate(aten_gm.graph.find_nodes(op="placeholder")) if node in written}


def measurement_inputs(args, written: set[int] | None) -> list:
    """The call's inputs for the measurement: those the graph writes (`written`; every tensor that
    does not require grad when unknown) copied, so that the measurement writes the copies; the
    rest as they are (gradients are taken with autograd.grad, which accumulates nothing)."""
    def copy(i, a) -> bool:
        return (isinstance(a, torch.Tensor) and not a.requires_grad
                and (i in written if written is not None else True))
    return [a.detach().clone() if copy(i, a) else a for i, a in enumerate(args)]


def runner(fn: Callable, args: list, training: bool, compared: list[int] | None = None) -> Callable[[], list]:
    """One call as the user's call runs: the forward; in training also the backward of every
    output that requires grad, with respect to the inputs that require grad. Returns the floating
    outputs and gradients (for `summary`): the gradients of the inputs at the positions `compared`
    only, where given (runs of different code that read different inputs compare those they share;
    an input unused gives zeros)."""
    positions = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    wrt = [args[k] for k in positions]
    shown = range(len(wrt)) if compared is None else [positions.index(k) for k in compared if k in positions]
    grads: dict = {}

    def call() -> list:
        leaves = [o for o in pytree.tree_leaves(fn(*args)) if isinstance(o, torch.Tensor) and o.is_floating_point()]
        outs = [o for o in leaves if o.grad_fn is not None]
        if not training or not wrt or not outs:
            return leaves
        if "g" not in grads:  # one fixed set of output gradients, as a loss would send: the same
            grads["g"] = [_fixed_randn(o, k) for k, o in enumerate(outs)]  # for every candidate
        got = torch.autograd.grad(outs, wrt, grads["g"], allow_unused=True)
        return leaves + [got[j] if got[j] is not None else torch.zeros_like(wrt[j]) for j in shown]
    return call


def _fixed_randn(like: torch.Tensor, k: int) -> torch.Tensor:
    """Random values of `like`'s shape, the same for every candidate (a seeded generator of their
    own: the user's random-number state is not touched), scaled so that their sum of squares is 1."""
    gen = torch.Generator(device=like.device)
    gen.manual_seed(1000 + k)
    noise = torch.randn(like.shape, generator=gen, device=like.device, dtype=torch.float32)
    return (noise / math.sqrt(max(like.numel(), 1))).to(like.dtype)


def summary(values: list) -> list:
    """Per tensor (finite everywhere, norm, its dtype's tolerance): what a candidate's outputs and
    gradients are compared by, without keeping them."""
    out = []
    for v in values:
        tolerance = 0.05 if v.dtype in (torch.float32, torch.float64) else 0.25  # 16-bit: the reference is noisy too
        v = v.detach().double()
        out.append((bool(v.isfinite().all()), float(v.nan_to_num().norm()), tolerance))
    return out


def disagreement(got: list, want: list) -> str:
    """Why a candidate's summary is not the reference's, or "": a different count, a value not
    finite where the reference's is, or a norm off by more than the dtype's tolerance (5% in
    fp32, 25% in 16 bits: the candidates round differently, a wrong one is off by far more)."""
    if len(got) != len(want):
        return f"{len(got)} outputs and gradients against {len(want)}"
    for k, ((fin, norm, _), (want_fin, want_norm, tolerance)) in enumerate(zip(got, want)):
        if want_fin and not fin:
            return f"output or gradient {k} is not finite where the captured graph's is"
        if want_fin and abs(norm - want_norm) > tolerance * want_norm + 1e-6:
            return f"output or gradient {k}: norm {norm:.4g} against {want_norm:.4g}"
    return ""


@dataclass
class Measurement:
    ms: dict = field(default_factory=dict)  # name -> ms per call (its best round)
    errors: dict = field(default_factory=dict)  # name -> why it was not timed


def measure(cands: dict[str, Callable], args, training: bool, device: torch.device,
            written: set[int] | None = None, clock=time.perf_counter) -> Measurement:
    """The candidates on copies of `args` (measurement_inputs), as the call runs (runner)."""
    inputs = measurement_inputs(args, written)
    return measure_runs({name: runner(fn, inputs, training) for name, fn in cands.items()}, device, clock,
                        reference=EAGER)


def measure_runs(runs: dict[str, Callable[[], list]], device: torch.device, clock=time.perf_counter,
                 reference: str | None = None) -> Measurement:
    """Interleaved rounds of each run (two warm-up calls first: the lazy parts of a build, a
    backward compile or a kernel's tuning, run there); each run's time is its best round's. A run
    that raises, or whose first outputs and gradients disagree with the `reference` run's
    (`disagreement`: a compiler's wrong answer is not a candidate), is dropped with its error. Wall
    time per call, the GPU synchronized around each round: what a plain call costs, host and GPU
    together."""
    from torch_xaccel.codegen.tuning import Progress

    result = Measurement()
    live, per_call = {}, {}
    progress = Progress("measuring candidates", len(runs))
    order = sorted(runs, key=lambda name: name != reference)  # the reference first
    want = None
    for n, name in enumerate(order):
        run = runs[name]
        try:
            got = summary(run())
            _sync(device)
            if name == reference:
                want = got
            elif want is not None and (why := disagreement(got, want)):
                result.errors[name] = f"disagrees with {reference}: {why}"
                progress.step(n + 1)
                continue
            t0 = clock()
            run()
            _sync(device)
            per_call[name] = max(clock() - t0, 1e-7) * 1e3
            live[name] = run
        except Exception as e:  # noqa: BLE001 - a candidate that does not run is not a candidate
            if _restart(e):
                raise
            result.errors[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        progress.step(n + 1)
    calls = {name: max(1, min(100, int(ROUND_MS / ms))) for name, ms in per_call.items()}
    samples: dict[str, list] = {name: [] for name in live}
    start, rounds = clock(), 0
    while live and rounds < ROUNDS_MAX and (rounds < ROUNDS_MIN or clock() - start < MEASURE_S):
        for name in list(live):
            try:
                _sync(device)
                t0 = clock()
                for _ in range(calls[name]):
                    live[name]()
                _sync(device)
                samples[name].append((clock() - t0) * 1e3 / calls[name])
            except Exception as e:  # noqa: BLE001 - e.g. out of memory on a later round
                result.errors[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                del live[name]
        rounds += 1
    progress.close()
    # the best round: interference (another process, a compile pool starting) only adds time
    result.ms = {name: min(samples[name]) for name in live if samples[name]}
    return result


def fallback_name(cands) -> str:
    """What runs when nothing could be measured: the captured graph under Inductor, else as it is."""
    return INDUCTOR if INDUCTOR in cands else EAGER


def describe(entry: dict, *, cached: bool) -> str:
    """The report's line: what runs and the times that chose it."""
    times = []
    for name, ms, why in entry.get("timings", []):
        times.append(f"{name} {ms:.3f} ms" if ms is not None else f"{name} ({why})")
    how = "stored decision" if cached else entry.get("mode", "measured")
    return f"runs {entry['config']} [{how}: " + ", ".join(times) + "]"


class Chooser:
    """The callable the backend returns when a graph's choice is not stored yet: at its first
    call it measures the candidates on that call's inputs, keeps the fastest and drops the rest."""

    def __init__(self, key: str, cands: list[Candidate], training: bool, device: torch.device, report,
                 written: set[int] | None = None):
        self.key, self.training, self.device, self.report = key, training, device, report
        self.written = written
        self.cands = {c.name: c for c in cands if c.fn is not None}
        self.build_errors = [[c.name, None, c.error] for c in cands if c.fn is None]
        self.fn: Callable | None = None

    def __call__(self, *args):
        fn = self.fn
        if fn is None:
            with self.report.timing("measuring at the first call"):
                fn = self.fn = self._choose(args)
        return fn(*args)

    def _choose(self, args) -> Callable:
        from torch_xaccel.codegen import tuning

        fns = {name: c.fn for name, c in self.cands.items()}
        fallback = fallback_name(fns)
        untimed = next((n for n in (XACCEL_EAGER, XACCEL_INDUCTOR) if n in fns), fallback)
        mode = "train step" if self.training else "forward"

        def tune() -> dict:
            rng = _Rng(self.device)
            try:
                m = measure(fns, list(args), self.training, self.device, self.written)
            finally:
                rng.restore()
            timings = [[n, round(m.ms[n], 5) if n in m.ms else None, m.errors.get(n, "")] for n in fns]
            best = min(m.ms, key=m.ms.get) if m.ms else fallback
            return {"config": best, "timings": timings + self.build_errors, "mode": f"measured, {mode}",
                    "build_s": {n: round(c.build_s, 3) for n, c in self.cands.items()}}

        try:
            decision = tuning.decide(self.key, untimed=untimed, valid=_valid, tune=tune)
            entry = decision.entry if _valid(decision.entry) else {
                "config": decision.config, "timings": self.build_errors,
                "mode": "not measured (Triton's interpreter, a CUDA-graph capture or XACCEL_TUNE=0)"}
        except Exception as e:  # noqa: BLE001 - a measurement that fails runs the captured graph
            if _restart(e):
                raise
            entry = {"config": fallback, "timings": self.build_errors,
                     "mode": f"measurement failed ({type(e).__name__}: {str(e)[:160]})"}
        name = entry["config"] if entry["config"] in fns else fallback
        entry = {**entry, "config": name}
        self.report.chosen, self.report.choice = name, describe(entry, cached=False)
        chosen = fns[name]
        self.cands.clear()  # the other candidates' compiled code and buffers go now
        return chosen


KEEP, REVERT = "keep", "revert"
# the region measurement's runs: each side as each rest runs it
WRITTEN_EAGER, WRITTEN_INDUCTOR, REPLACED_INDUCTOR = "written (eager)", "written (inductor)", "replaced (inductor)"


def _valid_region(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("config"), dict)
            and all(v in (KEEP, REVERT) for v in entry["config"].values()) and isinstance(entry.get("timings"), list))


def _region_inputs(values: dict, ids: list, training: bool) -> list:
    """The captured values for one side; in training its floating inputs require grad (the
    backward runs through the region as the step's would)."""
    out = []
    for i in ids:
        v = values[i]
        if isinstance(v, torch.Tensor):
            v = v.detach()
            if training and v.is_floating_point():
                v = v.requires_grad_(True)
        out.append(v)
    return out


def compile_region(gm: torch.fx.GraphModule, inputs: list, rest: str, replaced: bool) -> Callable:
    """The region as the rest would run it (inside apart_from_dynamo: its own fake mode and static
    shapes, the region's measured ones): eagerly as the eager rest runs a graph (xaccel ops called
    straight to their bodies, and in training inside aot_autograd's forward and backward graphs, not
    through the custom op's autograd layer, whose host time a compiled graph never pays); under
    Inductor. A replaced region beside the Inductor rest is its xaccel op, which Inductor calls
    through the dispatcher with nothing of the region left to fuse: it runs so, without an
    Inductor build (a region's build is most of what measuring it costs)."""
    from .backend import _compile_rest, _copied

    if not (replaced and rest == "inductor"):
        return _compile_rest(_copied(gm), inputs, rest, {})
    if not torch.is_grad_enabled():
        return gm.forward
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def as_traced(g, _inputs):
        return make_boxed_func(g.forward)

    return aot_autograd(fw_compiler=as_traced, bw_compiler=as_traced)(_copied(gm), inputs)


@contextlib.contextmanager
def apart_from_dynamo():
    """Region work done inside Dynamo's compile of the graph (an Inductor build of a region, the
    first backward that compiles its backward): no tracing context (the region has its own fake
    mode and static shapes) and compile metrics in a context of their own (Dynamo's refuses a
    second `is_forward`)."""
    tls, saved = None, None
    try:
        from torch._dynamo import utils as dynamo_utils
        from torch._dynamo.metrics_context import MetricsContext

        tls = dynamo_utils._metrics_context_tls
        saved = getattr(tls, "metrics_context", None)
        tls.metrics_context = MetricsContext(on_exit=lambda *args: None)
    except (ImportError, AttributeError):  # another torch: its own rules
        tls = None
    try:
        with torch._guards.tracing(None), (tls.metrics_context if tls is not None else contextlib.nullcontext()):
            yield
    finally:
        if tls is not None:
            if saved is None:
                del tls.metrics_context
            else:
                tls.metrics_context = saved


LARGE_REGION = 0.5  # a region kind this share of the graph is compared under Inductor by the graph's candidates


def _measure_region(sides, values: dict, rests: list, training: bool, device: torch.device,
                    share: float = 0.0) -> dict:
    """The region as replaced against the region as written, both as each rest's backend runs
    them, each side on its own captured inputs. The original is built under Inductor only where
    the replacement beats it run eagerly: elsewhere it goes back beside the Inductor rest unbuilt
    (an Inductor build of the original could only widen the gap, and is most of what measuring a
    region costs). Nor where the region's kind makes up most of the graph (`share` of its ops,
    at least LARGE_REGION: a loop over time steps unrolled): that build would cost about as much
    as the graph's own Inductor candidate, which holds the original too, so the replacement stays
    beside the Inductor rest and the graph's candidates (xaccel with the Inductor rest, Inductor)
    compare the two."""
    replaced_in = _region_inputs(values, sides.replaced_inputs, training)
    written_in = _region_inputs(values, sides.written_inputs, training)
    # gradients compared for the values both sides read (a side may read a survivor the other
    # computes for itself, e.g. a weight's transpose)
    common = [i for i in sides.written_inputs if i in set(sides.replaced_inputs)]
    compared = {"replaced": [sides.replaced_inputs.index(i) for i in common],
                "written": [sides.written_inputs.index(i) for i in common]}
    side_of = {"replaced": (sides.replaced, replaced_in), "written": (sides.written, written_in)}
    runs, errors, times = {}, {}, {}

    def build(side: str, rest: str) -> None:
        gm, inputs = side_of[side]
        try:
            # each side in a compile context of its own, its first call included: that is where
            # aot_autograd compiles its backward (one backward per metrics context)
            t0 = time.perf_counter()
            with apart_from_dynamo():
                run = runner(compile_region(gm, inputs, rest, side == "replaced"), inputs, training, compared[side])
                run()
            runs[f"{side} ({rest})"] = run
            logs.log.debug("region side %s (%s) built and first run in %.2f s", side, rest, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - a side that does not build: the other side decides
            if _restart(e):
                raise
            errors[f"{side} ({rest})"] = f"build failed: {type(e).__name__}: {str(e)[:160]}"

    def measure(names) -> None:
        """Interleaved rounds of these runs, the original run eagerly beside them as the reference
        whose outputs and gradients check theirs."""
        m = measure_runs({n: runs[n] for n in dict.fromkeys([WRITTEN_EAGER, *names]) if n in runs}, device,
                         reference=WRITTEN_EAGER if WRITTEN_EAGER in runs else None)
        errors.update(m.errors)
        times.update(m.ms)

    for rest in rests:
        build("replaced", rest)
    build("written", "eager")
    measure(list(runs))
    unbuilt = False  # the original not built under Inductor: the replacement failed, or lost to it run eagerly
    if "inductor" in rests:
        mine = times.get(REPLACED_INDUCTOR)
        beats_eager = mine is not None and mine < times.get(WRITTEN_EAGER, math.inf)
        if beats_eager and share >= LARGE_REGION:
            errors[WRITTEN_INDUCTOR] = (f"not built: the region is {share:.0%} of the graph, compared under Inductor "
                                        "by the graph's candidates")
        elif beats_eager:
            build("written", "inductor")
            if WRITTEN_INDUCTOR in runs:
                measure([REPLACED_INDUCTOR, WRITTEN_INDUCTOR])
        else:
            unbuilt = True
            errors[WRITTEN_INDUCTOR] = ("not built: the replacement did not run" if mine is None else
                                        "not built: the replacement is slower than the original run eagerly")
    config = {}
    for rest in rests:
        mine, theirs = times.get(f"replaced ({rest})"), times.get(f"written ({rest})")
        # the original is put back where it measured faster, or where the replacement failed
        lost = theirs is not None and (mine is None or theirs < mine)
        config[rest] = REVERT if lost or (rest == "inductor" and unbuilt) else KEEP
    timings = [[n, round(times[n], 5) if n in times else None, errors.get(n, "")]
               for n in dict.fromkeys([*runs, *errors])]
    return {"config": config, "timings": timings, "mode": "train step" if training else "forward"}


def choose_regions(diff, example_inputs, training: bool, rests: list, device: torch.device,
                   settings: str) -> tuple[dict, list]:
    """({rest: the regions to put back as written}, the report's lines). Regions with one
    signature (the layers of a stack) share one measurement, on the values the first of them
    reads when the graph runs on its example inputs; decisions are stored like the graph's."""
    from torch_xaccel.codegen import tuning
    from torch_xaccel.lowering.graph_utils import location

    from . import regions as _regions

    groups: dict = {}
    for region in diff.regions:
        groups.setdefault(diff.signature(region), []).append(region)
    sides = {sig: diff.sides(members[0]) for sig, members in groups.items()}
    captured: list = []  # the one run of the original graph, made when a region is first measured

    def values() -> dict:
        if not captured:
            ids = {i for s in sides.values() if s is not None for i in (*s.replaced_inputs, *s.written_inputs)}
            rng = _Rng(device)
            try:
                captured.append(_regions.capture(diff.original, ids, example_inputs))
            finally:
                rng.restore()
        return captured[0]

    revert = {rest: [] for rest in rests}
    lines = []
    ops = _count_ops(diff.original)
    for sig, members in groups.items():
        where = f"{members[0].label} ({len(members)} alike) at {location(members[0].new[-1])}"
        if sides[sig] is None:
            lines.append(f"{where}: kept, not measured (its original cannot be cut out on its own)")
            continue
        key = tuning.key("region", f"{sig}|{training}|{','.join(rests)}|{settings}", device, code_digest())

        def tune(s=sides[sig], n=len(members)) -> dict:
            rng = _Rng(device)
            try:
                with apart_from_dynamo(), tuning.trial():  # (an op put back leaves no builds running)
                    return _measure_region(s, values(), rests, training, device,
                                           share=n * _count_ops(s.written) / max(ops, 1))
            finally:
                rng.restore()
        try:
            decision = tuning.decide(key, untimed={r: KEEP for r in rests}, valid=_valid_region, tune=tune)
            entry = decision.entry if _valid_region(decision.entry) else {"config": decision.config, "timings": []}
        except Exception as e:  # noqa: BLE001 - a measurement that fails puts the original back
            if _restart(e):
                raise
            entry = {"config": {r: REVERT for r in rests}, "timings": [],
                     "mode": f"measurement failed ({type(e).__name__}: {str(e)[:160]})"}
        for rest in rests:
            if entry["config"].get(rest) == REVERT:
                revert[rest].extend(members)
        said = ", ".join(f"{'put back' if v == REVERT else 'kept'} beside the {r} rest"
                         for r, v in entry["config"].items())
        times = ", ".join(f"{n} {ms:.3f} ms" if ms is not None else f"{n} ({why})" for n, ms, why in entry["timings"])
        lines.append(f"{where}: {said} [{entry.get('mode', 'stored')}: {times}]")
        logs.log.debug("region %s", lines[-1])  # as each is decided (the report comes after the compile)
    return revert, lines


def _count_ops(gm: torch.fx.GraphModule) -> int:
    return sum(1 for node in gm.graph.nodes if node.op == "call_function")


def same_outputs(a: torch.fx.GraphModule, b: torch.fx.GraphModule, args) -> bool:
    """Whether two graphs compute the same outputs on args, without grad, the random-number state
    put back after each: a check that a rewired graph is wired right (`disagreement`'s rule for
    floating outputs, exact equality for the others)."""
    device = device_of(args)
    outs = []
    for g in (a, b):
        rng = _Rng(device)
        try:
            with torch.no_grad():
                outs.append(pytree.tree_leaves(torch.fx.Interpreter(g).run(*measurement_inputs(args, None))))
        except Exception:  # noqa: BLE001 - a graph that does not run is not the same
            return False
        finally:
            rng.restore()
    if len(outs[0]) != len(outs[1]):
        return False
    floats = [[], []]
    for x, y in zip(*outs):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.is_floating_point():
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            floats[0].append(x)
            floats[1].append(y)
        elif type(x) is not type(y) or not (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y):
            return False
    return not disagreement(summary(floats[0]), summary(floats[1]))
