"""The measured choice (torch_xaccel/choice.py): each graph runs as the fastest of its candidates.

Most tests give the measurement fixed times (the logic under test is what is done with them) and
let the eager rest stand in for Inductor (Inductor's C++ builds take minutes on a small CPU);
test_real_inductor_candidates builds and times the real ones."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_xaccel import backend, choice
from torch_xaccel.report import last_report

NAMES = (choice.XACCEL_EAGER, choice.XACCEL_INDUCTOR, choice.INDUCTOR, choice.EAGER)


class Block(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def _stand_in_for_inductor(monkeypatch):
    real = backend._compile_rest

    def compile_rest(gm, example_inputs, fallback, patches, *args, **kwargs):
        return real(gm, example_inputs, "eager", patches, *args, **kwargs)
    monkeypatch.setattr(backend, "_compile_rest", compile_rest)  # (the regions' sides' too)


def _region_outcome(monkeypatch, put_back=lambda code: False, calls: list | None = None):
    """Regions measured with fixed outcomes: put back where put_back(the replaced side's code)."""
    def measure_region(sides, values, rests, training, device, share=0.0):
        if calls is not None:
            calls.append(sides.replaced.code)
        back = put_back(sides.replaced.code)
        timings = [[f"{side} ({r})", (2.0 if back else 1.0) if side == "replaced" else 1.5, ""]
                   for r in rests for side in ("replaced", "written")]
        return {"config": {r: choice.REVERT if back else choice.KEEP for r in rests}, "timings": timings,
                "mode": "fixed"}
    monkeypatch.setattr(choice, "_measure_region", measure_region)


def _candidate_rewritten(monkeypatch, rest: str, replaced: bool, rewrite):
    """The candidate built under `rest` from a graph with (replaced) or without xaccel ops gets
    rewrite(its compiled function) (the eager rest stands in for Inductor)."""
    real = backend._compile_rest

    def compile_rest(gm, example_inputs, fallback, patches, *args, **kwargs):
        fn = real(gm, example_inputs, "eager", patches, *args, **kwargs)
        has_ops = any(str(n.target).startswith("xaccel.") for n in gm.graph.nodes)
        return rewrite(fn) if fallback == rest and has_ops == replaced else fn
    monkeypatch.setattr(backend, "_compile_rest", compile_rest)


@pytest.fixture
def choosing(xaccel_env, tmp_path, monkeypatch):
    xaccel_env(XACCEL_CHOOSE="1", XACCEL_CACHE_DIR=str(tmp_path))
    _stand_in_for_inductor(monkeypatch)
    _region_outcome(monkeypatch)
    return tmp_path


def _fixed_times(monkeypatch, ms: dict, calls: list | None = None):
    def measure(cands, args, training, device, written=None, clock=None):
        if calls is not None:
            calls.append(sorted(cands))
        return choice.Measurement(ms={n: ms[n] for n in cands if n in ms})
    monkeypatch.setattr(choice, "measure", measure)


def _train_step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _check_against_eager(compiled, model, x):
    out, grads = _train_step(compiled, x)
    ref, ref_grads = _train_step(model, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("winner", NAMES)
def test_the_fastest_candidate_runs_and_the_report_says_so(choosing, monkeypatch, winner):
    times = {n: 2.0 for n in NAMES} | {winner: 1.0}
    _fixed_times(monkeypatch, times)
    model, x = Block(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    graph = last_report().graphs[0]
    assert graph.chosen == winner
    assert f"runs {winner} [measured, train step:" in str(last_report())
    assert graph.replacements  # what was found stays reported beside what runs


def test_the_report_says_where_the_first_call_went(choosing, monkeypatch):
    """Each phase of a first call (the compile's trace, passes, region measurements and candidate
    builds, then the measurement at the call) in the report; a stored decision builds its winner
    alone."""
    _fixed_times(monkeypatch, {n: 2.0 for n in NAMES} | {choice.INDUCTOR: 1.0})
    model, x = Block(), torch.randn(16, 32)
    torch.compile(model, backend="xaccel")(x)
    phases = list(last_report().graphs[0].compile_s)
    assert phases == ["trace", "passes", "regions", *(f"build {n}" for n in NAMES),
                      "measuring at the first call"], phases
    assert " first call: trace " in str(last_report())
    torch._dynamo.reset()
    torch.compile(model, backend="xaccel")(x)
    assert list(last_report().graphs[0].compile_s) == [f"build {choice.INDUCTOR}"]


@pytest.mark.parametrize("winner", [choice.EAGER, choice.XACCEL_EAGER])
def test_only_the_chosen_candidate_runs(choosing, monkeypatch, winner):
    """A region whose measured alternative wins stays as written: the xaccel op never runs."""
    _fixed_times(monkeypatch, {n: 2.0 for n in NAMES} | {winner: 1.0})
    calls = []
    from torch_xaccel import ops

    target = torch.ops.xaccel.gemm_epilogue.default
    real = ops.DIRECT_CALLS[target]

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setitem(ops.DIRECT_CALLS, target, counted)
    model, x = Block(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="xaccel")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        compiled(x)
    assert last_report().graphs[0].chosen == winner
    assert bool(calls) == (winner == choice.XACCEL_EAGER)


def test_a_measurement_that_fails_runs_the_captured_graph_under_inductor(choosing, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("timer broke")
    monkeypatch.setattr(choice, "measure", broken)
    model, x = Block(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    graph = last_report().graphs[0]
    assert graph.chosen == choice.INDUCTOR and "measurement failed (RuntimeError: timer broke)" in graph.choice


def test_a_candidate_that_fails_is_dropped_with_its_error(choosing, monkeypatch):
    """Real timing; the eager-rest candidate raises at its first call."""
    def broken(fn):
        def call(*a):
            raise RuntimeError("kernel exploded")
        return call
    _candidate_rewritten(monkeypatch, "eager", True, broken)
    model, x = Block(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    graph = last_report().graphs[0]
    assert graph.chosen != choice.XACCEL_EAGER
    assert "xaccel (eager rest) (failed: RuntimeError: kernel exploded)" in graph.choice


def test_a_candidate_that_fails_to_build_is_dropped(choosing, monkeypatch):
    real = backend._compile_rest

    def compile_rest(gm, example_inputs, fallback, patches, *args, **kwargs):
        if any(str(n.target).startswith("xaccel.") for n in gm.graph.nodes):
            raise ValueError("no build today")
        return real(gm, example_inputs, "eager", patches, *args, **kwargs)
    monkeypatch.setattr(backend, "_compile_rest", compile_rest)
    _fixed_times(monkeypatch, {n: 1.0 for n in NAMES})
    model, x = Block(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    graph = last_report().graphs[0]
    assert graph.chosen in choice.ANCHORS and "build failed: ValueError: no build today" in graph.choice


def _choice_entries(cache: Path, kind: str = "choice") -> list[Path]:
    return [p for p in (cache / "tuning").glob("*.json") if json.loads(p.read_text())["key"].startswith(kind + "|")]


def test_decisions_are_reused_and_a_damaged_one_is_measured_again(choosing, monkeypatch):
    calls = []
    _fixed_times(monkeypatch, {choice.XACCEL_EAGER: 1.0, choice.XACCEL_INDUCTOR: 2.0, choice.INDUCTOR: 3.0,
                               choice.EAGER: 4.0}, calls)
    model, x = Block(), torch.randn(16, 32)
    torch.compile(model, backend="xaccel")(x)
    assert len(calls) == 1 and len(_choice_entries(choosing)) == 1
    torch._dynamo.reset()
    torch.compile(model, backend="xaccel")(x)
    assert len(calls) == 1 and "runs xaccel (eager rest) [stored decision" in last_report().graphs[0].choice
    entry, = _choice_entries(choosing)
    entry.write_text("{ not json")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    assert len(calls) == 2 and "[measured" in last_report().graphs[0].choice
    assert json.loads(entry.read_text())["value"]["config"] == choice.XACCEL_EAGER  # rebuilt


def test_other_shapes_are_chosen_anew(choosing, monkeypatch):
    calls = []
    _fixed_times(monkeypatch, {n: 1.0 for n in NAMES}, calls)
    model = Block()
    torch.compile(model, backend="xaccel", dynamic=False)(torch.randn(16, 32))
    torch.compile(model, backend="xaccel", dynamic=False)(torch.randn(24, 32))
    assert len(calls) == 2


_PROCESS = textwrap.dedent("""
    import torch, torch.nn as nn, torch.nn.functional as F
    from torch_xaccel import backend, choice
    from torch_xaccel.report import last_report

    real = backend._compile_rest
    backend._compile_rest = lambda gm, ex, fallback, patches, *a, **k: real(gm, ex, "eager", patches, *a, **k)
    def measure(cands, args, training, device, written=None, clock=None):
        return choice.Measurement(ms={n: (1.0 if n == choice.INDUCTOR else 2.0) for n in cands})
    choice.measure = measure

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    with torch.no_grad():
        out = torch.compile(model, backend="xaccel")(torch.ones(8, 32))
        assert torch.allclose(out, model(torch.ones(8, 32)), atol=1e-5)
    graph = last_report().graphs[0]
    print("CHOICE", graph.choice)
    print("REPLACED", len(graph.replacements))
""")


def test_decisions_are_reused_across_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("XACCEL_")}
    env.update(XACCEL_CHOOSE="1", XACCEL_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).parents[1]))
    script = tmp_path / "run.py"
    script.write_text(_PROCESS)
    first = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    second = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "CHOICE runs inductor [measured, forward:" in first.stdout and "REPLACED 1" in first.stdout
    # the stored winner is an anchor: the second process builds only it, without lowering anything
    assert "CHOICE runs inductor [stored decision:" in second.stdout and "REPLACED 0" in second.stdout


class Counting(nn.Module):
    """Writes a buffer in place at every call: the measurement must not write it again."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.block(x)


def test_inputs_written_in_place_are_written_once(xaccel_env, tmp_path, monkeypatch):
    xaccel_env(XACCEL_CHOOSE="1", XACCEL_CACHE_DIR=str(tmp_path))
    _stand_in_for_inductor(monkeypatch)
    model, x = Counting(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="xaccel")
    with torch.no_grad():
        compiled(x)
        assert model.calls.item() == 1
        compiled(x)
    assert model.calls.item() == 2 and last_report().graphs[0].choice.startswith("runs ")


class Dropping(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return F.dropout(self.block(x), p=0.5, training=True)


def test_the_first_call_draws_the_random_numbers_a_later_one_does(choosing):
    """The measurement puts the random-number state back: the first call's dropout mask is the
    one the same seed gives a later call."""
    compiled = torch.compile(Dropping(), backend="xaccel")
    x = torch.randn(16, 32)
    torch.manual_seed(7)
    first = compiled(x)
    torch.manual_seed(7)
    second = compiled(x)
    torch.testing.assert_close(first, second)
    assert last_report().graphs[0].choice.startswith("runs ")


def test_choice_off_runs_the_replacements(xaccel_env, tmp_path):
    xaccel_env(XACCEL_CHOOSE="0", XACCEL_CACHE_DIR=str(tmp_path))
    model, x = Block(), torch.randn(16, 32)
    _check_against_eager(torch.compile(model, backend="xaccel"), model, x)
    graph = last_report().graphs[0]
    assert graph.replacements and not graph.choice and not _choice_entries(tmp_path)


def test_real_inductor_candidates(xaccel_env, tmp_path):
    """Every candidate built and timed for real (Inductor's CPU code included): the regions
    against their originals at compile time, the graph's candidates at its first call."""
    xaccel_env(XACCEL_CHOOSE="1", XACCEL_CACHE_DIR=str(tmp_path))
    model, x = Block(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="xaccel")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    graph = last_report().graphs[0]
    assert len(graph.region_choices) == 2  # the two chains, one region each (one feeds the other)
    for region in graph.region_choices:
        assert region.startswith("gemm_epilogue (1 alike) at test_choice.py")
        for side in ("replaced (eager)", "written (eager)", "replaced (inductor)", "written (inductor)"):
            assert f"{side} " in region
    for name in (choice.INDUCTOR, choice.EAGER):  # the xaccel candidates too, where their region stayed
        assert f"{name} " in graph.choice
    graph_entry, = [json.loads(p.read_text())["value"] for p in _choice_entries(tmp_path)]
    assert all(ms is not None and ms > 0 for _, ms, _ in graph_entry["timings"])


class TwoRegions(nn.Module):
    """Two replaced regions of different kinds, apart (a layer norm between them), and an
    mLSTM (the paper's parallel form) beside them."""

    def __init__(self, d: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.up, self.down, self.norm = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(4 * d)
        self.qkv, self.gates = nn.Linear(d, 3 * d), nn.Linear(d, 2 * heads)

    def forward(self, x):
        from tests.mlstm import spellings

        B, S, d = x.shape
        q, k, v = (t.view(B, S, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        i, f = (t.transpose(1, 2) for t in self.gates(x).chunk(2, -1))
        h = spellings.paper(q, k, v, i, f).transpose(1, 2).reshape(B, S, d)
        return h + self.down(self.norm(F.gelu(self.up(x)))) + x


def _counting_ops(monkeypatch) -> dict:
    from torch_xaccel import ops

    counts: dict = {}
    for target, real in list(ops.DIRECT_CALLS.items()):
        def counted(*args, target=target, real=real, **kwargs):
            name = str(target).split(".")[1]
            counts[name] = counts.get(name, 0) + 1
            return real(*args, **kwargs)
        monkeypatch.setitem(ops.DIRECT_CALLS, target, counted)
    return counts


@pytest.mark.parametrize("put_back", ["gelu", "mlstm"])
def test_a_region_slower_than_its_original_is_put_back(choosing, monkeypatch, put_back):
    """The mLSTM region, or one GEMM chain, measured slower than as written: that region runs as
    the user wrote it, the others stay replaced, and the model computes what eager does, in the
    forward and the gradients."""
    _region_outcome(monkeypatch, put_back=lambda code: put_back in code)
    _fixed_times(monkeypatch, {choice.XACCEL_EAGER: 1.0, choice.XACCEL_INDUCTOR: 2.0, choice.INDUCTOR: 3.0,
                               choice.EAGER: 4.0})
    counts = _counting_ops(monkeypatch)
    torch.manual_seed(0)
    model, x = TwoRegions(), torch.randn(2, 24, 32)
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    graph = last_report().graphs[0]
    assert graph.chosen == choice.XACCEL_EAGER and len(graph.region_choices) == 3
    back = [line for line in graph.region_choices if "put back" in line]
    assert len(back) == 1 and ("mlstm" in back[0]) == (put_back == "mlstm")
    counts.clear()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert ("mlstm" in counts) == (put_back != "mlstm")
    assert counts.get("gemm_epilogue") == (2 if put_back == "mlstm" else 1)


def test_every_region_put_back_leaves_only_the_captured_graph(choosing, monkeypatch):
    _region_outcome(monkeypatch, put_back=lambda code: True)
    calls = []
    _fixed_times(monkeypatch, {n: 1.0 for n in NAMES}, calls)
    model, x = TwoRegions(), torch.randn(2, 24, 32)
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    assert calls == [sorted(choice.ANCHORS)]


def test_region_decisions_are_stored(choosing, monkeypatch):
    measured = []
    _region_outcome(monkeypatch, put_back=lambda code: "gelu" in code, calls=measured)
    _fixed_times(monkeypatch, {n: 1.0 for n in NAMES})
    model, x = TwoRegions(), torch.randn(2, 24, 32)
    torch.compile(model, backend="xaccel")(x)
    assert len(measured) == 3 and len(_choice_entries(choosing, "region")) == 3
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    assert len(measured) == 3 and sum("put back" in line for line in last_report().graphs[0].region_choices) == 1


def test_regions_are_measured_as_trials(choosing, monkeypatch):
    """A region is measured inside tuning.trial(), so that work which pays off only for an op that
    stays (CUTLASS builds) waits for the op's next call: a replacement put back leaves none."""
    from torch_xaccel.codegen import tuning

    seen, fixed = [], choice._measure_region
    monkeypatch.setattr(choice, "_measure_region", lambda *a, **k: seen.append(tuning.in_trial()) or fixed(*a, **k))
    _fixed_times(monkeypatch, {n: 1.0 for n in NAMES})
    torch.compile(TwoRegions(), backend="xaccel")(torch.randn(2, 24, 32))
    assert len(seen) == 3 and all(seen) and not tuning.in_trial()


def test_a_region_measurement_that_fails_puts_the_original_back(choosing, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no clock")
    monkeypatch.setattr(choice, "_measure_region", broken)
    _fixed_times(monkeypatch, {n: 1.0 for n in NAMES})
    model, x = Block(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    lines = last_report().graphs[0].region_choices
    assert len(lines) == 2
    for line in lines:
        assert "put back beside the eager rest" in line and "measurement failed (RuntimeError: no clock)" in line


def test_regions_measured_for_real_on_captured_values(choosing, monkeypatch):
    """The real region measurement (no fixed outcome): each side runs on the values the region
    reads in the graph's example call; whatever it decides, the model stays right."""
    monkeypatch.undo()  # the real _measure_region, but keep the Inductor stand-in and the switches
    _stand_in_for_inductor(monkeypatch)
    monkeypatch.setenv("XACCEL_CHOOSE", "1")
    monkeypatch.setenv("XACCEL_CACHE_DIR", str(choosing))
    model, x = TwoRegions(), torch.randn(2, 24, 32)
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    lines = last_report().graphs[0].region_choices
    assert len(lines) == 3, lines
    for line in lines:  # every side built and timed, under both rests (Inductor's stand-in: eager)
        assert "failed" not in line, line
        for side in ("replaced (eager)", "written (eager)", "replaced (inductor)"):
            assert re.search(re.escape(side) + r" \d+\.\d+ ms", line), (side, line)
        # the original under Inductor: timed, or not built where the replacement lost to it run eagerly
        assert (re.search(r"written \(inductor\) \d+\.\d+ ms", line)
                or "written (inductor) (not built: the replacement is slower than the original run eagerly)" in line
                and "put back beside the inductor rest" in line), line


def test_a_region_is_measured_as_the_eager_rest_runs_it(choosing, monkeypatch):
    """In a train step the eager rest runs the replaced region inside aot_autograd's graphs, its op
    called straight to its body: the region's measurement runs it so too, never through the custom
    op's autograd layer (host time the compiled step does not pay, which would make a replacement
    look slower than it is)."""
    from torch_xaccel import ops
    from torch_xaccel.ops.gemm_epilogue import op as gemm_op

    monkeypatch.undo()  # the real _measure_region, with the Inductor stand-in
    _stand_in_for_inductor(monkeypatch)
    monkeypatch.setenv("XACCEL_CHOOSE", "1")
    monkeypatch.setenv("XACCEL_CACHE_DIR", str(choosing))
    monkeypatch.setenv("XACCEL_FALLBACK", "eager")  # (beside the Inductor rest the op goes through the dispatcher)
    _fixed_times(monkeypatch, {n: 2.0 for n in NAMES} | {choice.INDUCTOR: 1.0})  # the graph: no xaccel op
    target = torch.ops.xaccel.gemm_epilogue.default
    direct, through_the_op, measuring = [], [], []
    real_body, real_measure_runs = ops.DIRECT_CALLS[target], choice.measure_runs

    def body(*args, **kwargs):
        direct.append(bool(measuring))
        return real_body(*args, **kwargs)

    def op_body(*args, **kwargs):  # what the custom op runs when called through the dispatcher
        through_the_op.append(bool(measuring))
        return real_body(*args, **kwargs)

    def measure_runs(*args, **kwargs):  # the region's timed calls
        measuring.append(1)
        try:
            return real_measure_runs(*args, **kwargs)
        finally:
            measuring.pop()
    monkeypatch.setitem(ops.DIRECT_CALLS, target, body)
    monkeypatch.setattr(gemm_op, "run", op_body)
    monkeypatch.setattr(choice, "measure_runs", measure_runs)
    model, x = Block(), torch.randn(16, 32)
    _check_against_eager(torch.compile(model, backend="xaccel"), model, x)
    assert last_report().graphs[0].chosen == choice.INDUCTOR
    assert any(direct) and not any(through_the_op)


def _region_times(monkeypatch, choosing, ms: dict) -> list:
    """The real region measurement with fixed times per run name; returns the (side, rest) pairs
    built."""
    monkeypatch.undo()  # the real _measure_region, with the Inductor stand-in
    _stand_in_for_inductor(monkeypatch)
    monkeypatch.setenv("XACCEL_CHOOSE", "1")
    monkeypatch.setenv("XACCEL_CACHE_DIR", str(choosing))
    _fixed_times(monkeypatch, {n: 1.0 for n in NAMES})
    built, real_compile = [], choice.compile_region

    def compile_region(gm, inputs, rest, replaced):
        built.append(("replaced" if replaced else "written", rest))
        return real_compile(gm, inputs, rest, replaced)
    monkeypatch.setattr(choice, "compile_region", compile_region)
    monkeypatch.setattr(choice, "measure_runs", lambda runs, device, reference=None: choice.Measurement(
        ms={n: ms[n] for n in runs}))
    return built


@pytest.mark.parametrize("inductor_ms, kept", [(0.4, False), (0.6, True)])
def test_a_replacement_faster_than_the_original_eagerly_meets_it_under_inductor(choosing, monkeypatch,
                                                                               inductor_ms, kept):
    built = _region_times(monkeypatch, choosing, {"replaced (eager)": 0.5, "written (eager)": 1.0,
                                                  "replaced (inductor)": 0.5, "written (inductor)": inductor_ms})
    monkeypatch.setattr(choice, "LARGE_REGION", 1.01)  # (Block's one region is nearly all of its graph)
    model, x = Block(), torch.randn(16, 32)
    _check_against_eager(torch.compile(model, backend="xaccel"), model, x)
    assert ("written", "inductor") in built
    for line in last_report().graphs[0].region_choices:
        assert "kept beside the eager rest" in line
        assert f"{'kept' if kept else 'put back'} beside the inductor rest" in line, line


def test_a_region_that_is_most_of_the_graph_is_compared_under_inductor_by_the_graphs_candidates(choosing,
                                                                                                monkeypatch):
    """Building the original of a region that makes up most of the graph (a loop over time steps)
    under Inductor costs about what the graph's own Inductor candidate costs, and that candidate
    holds the original: the replacement stays beside the Inductor rest unbuilt there, and the
    graph's candidates compare the two."""
    built = _region_times(monkeypatch, choosing, {"replaced (eager)": 0.5, "written (eager)": 1.0,
                                                  "replaced (inductor)": 0.5})
    model, x = Block(), torch.randn(16, 32)
    _check_against_eager(torch.compile(model, backend="xaccel"), model, x)
    assert ("written", "inductor") not in built
    lines = last_report().graphs[0].region_choices
    assert lines and all("kept beside the eager rest, kept beside the inductor rest" in line
                         and "of the graph, compared under Inductor by the graph's candidates" in line
                         for line in lines), lines


def test_a_replacement_slower_than_the_original_eagerly_goes_back_without_an_inductor_build(choosing, monkeypatch):
    """Inductor's build of the original could only widen the gap: the region goes back beside the
    Inductor rest unbuilt (its build is most of what measuring a region costs)."""
    built = _region_times(monkeypatch, choosing, {"replaced (eager)": 2.0, "written (eager)": 1.0,
                                                  "replaced (inductor)": 1.5})
    model, x = Block(), torch.randn(16, 32)
    _check_against_eager(torch.compile(model, backend="xaccel"), model, x)
    assert ("written", "inductor") not in built and ("replaced", "inductor") in built
    lines = last_report().graphs[0].region_choices
    assert lines and all("put back beside the eager rest, put back beside the inductor rest" in line
                         and "written (inductor) (not built: the replacement is slower than the original run eagerly)"
                         in line for line in lines), lines


def test_regions_are_not_measured_where_the_graph_writes_its_inputs(choosing, monkeypatch):
    _fixed_times(monkeypatch, {n: 1.0 for n in NAMES})
    model, x = Counting(), torch.randn(16, 32)
    with torch.no_grad():
        torch.compile(model, backend="xaccel")(x)
    assert model.calls.item() == 1 and last_report().graphs[0].region_choices == []


def test_adjacent_regions_are_put_back_one_by_one(choosing, monkeypatch):
    """Two chains where one feeds the other: each is a region of its own (the value between them
    replaced an original's), so the first can run as written while the second stays replaced."""
    _region_outcome(monkeypatch, put_back=lambda code: "gelu" in code)
    _fixed_times(monkeypatch, {n: 2.0 for n in NAMES} | {choice.XACCEL_EAGER: 1.0})
    counts = _counting_ops(monkeypatch)
    model, x = Block(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    lines = last_report().graphs[0].region_choices
    assert len(lines) == 2 and sum("put back" in line for line in lines) == 1
    counts.clear()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert counts == {"gemm_epilogue": 1}


def test_a_rewiring_that_changes_the_outputs_keeps_the_replacements(choosing, monkeypatch):
    _region_outcome(monkeypatch, put_back=lambda code: "gelu" in code)
    _fixed_times(monkeypatch, {n: 2.0 for n in NAMES} | {choice.XACCEL_EAGER: 1.0})
    monkeypatch.setattr(choice, "same_outputs", lambda a, b, args: False)
    counts = _counting_ops(monkeypatch)
    model, x = Block(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="xaccel")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert counts == {"gemm_epilogue": 2}
    assert any("did not rewire cleanly" in line for line in last_report().graphs[0].region_choices)


def test_same_outputs_tells_a_miswired_graph():
    gm = torch.fx.symbolic_trace(lambda x, y: x * 2 + y)
    wrong = torch.fx.symbolic_trace(lambda x, y: y * 2 + x)
    args = [torch.randn(8) * 10, torch.randn(8)]  # x dominates: the swap doubles the norm (a check by norms)
    assert choice.same_outputs(gm, gm, args) and not choice.same_outputs(gm, wrong, args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_regions_and_graph_choice_for_real(xaccel_env, tmp_path, dtype):
    """On CUDA, nothing stubbed: the regions measured against their originals under Inductor
    (built apart from Dynamo's compile, its backward compiled at the first backward), the graph's
    candidates at its first train step; the step computes what eager does."""
    xaccel_env(XACCEL_CHOOSE="1", XACCEL_CACHE_DIR=str(tmp_path))
    torch.manual_seed(0)
    model = TwoRegions(d=64).cuda().to(dtype)
    x = torch.randn(2, 128, 64, device="cuda", dtype=dtype)
    compiled = torch.compile(model, backend="xaccel")
    out, grads = _train_step(compiled, x)
    ref, ref_grads = _train_step(model, x)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out, ref, **tol)
    for g, r in zip(grads, ref_grads):
        assert (g.float() - r.float()).norm() <= 0.05 * r.float().norm() + 1e-3
    graph = last_report().graphs[0]
    assert len(graph.region_choices) == 3
    assert all("written (inductor) " in line and " ms" in line for line in graph.region_choices), graph.region_choices
    assert graph.chosen and "[measured, train step:" in graph.choice


def test_a_region_as_written_is_the_whole_code_it_replaced(choosing, monkeypatch):
    """The mLSTM region's original side holds the parallel form from the gates to h (a value its
    own replacement holds is computed there, not taken as an input)."""
    seen = []

    def measure_region(sides, values, rests, training, device, share=0.0):
        seen.append((sides.replaced.code, sides.written.code, len(sides.written_inputs)))
        return {"config": {r: choice.KEEP for r in rests}, "timings": [], "mode": "fixed"}
    monkeypatch.setattr(choice, "_measure_region", measure_region)
    _fixed_times(monkeypatch, {n: 1.0 for n in NAMES})
    model, x = TwoRegions(), torch.randn(2, 24, 32)
    _check_against_eager(torch.compile(model, backend="xaccel"), model, x)
    (replaced, written, n_inputs), = [s for s in seen if "xaccel.mlstm" in s[0]]
    for op in ("log_sigmoid", "cumsum", "exp", "amax" if "amax" in written else "max", "matmul"):
        assert op in written, op
    assert "xaccel" not in written and n_inputs <= 6  # q, k, v, i, f (and a constant at most)


def test_every_region_put_back_keeps_xaccel_candidates_where_the_capture_holds_xaccel_ops(choosing, monkeypatch):
    """A library call substituted while Dynamo traced (the xlstm package's mLSTM, sLSTM) is an
    xaccel op in the captured graph itself: with every region put back the xaccel candidates still
    differ from the captured graph's own and stay candidates."""
    _region_outcome(monkeypatch, put_back=lambda code: True)
    calls = []
    _fixed_times(monkeypatch, {n: 1.0 for n in NAMES}, calls)
    monkeypatch.setattr(backend, "_holds_xaccel_ops", lambda gm: True)
    model, x = TwoRegions(), torch.randn(2, 24, 32)
    _check_against_eager(torch.compile(model, backend="xaccel"), model, x)
    assert calls == [sorted(NAMES)]


def test_a_candidate_with_a_wrong_answer_is_dropped(choosing, monkeypatch):
    """A compiler's wrong answer (here Inductor's stand-in doubles the output; NaN gradients seen
    from Inductor on some forms) is not a candidate, however fast."""
    _candidate_rewritten(monkeypatch, "inductor", False, lambda fn: lambda *a: [t * 2 for t in fn(*a)])
    model, x = Block(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    graph = last_report().graphs[0]
    assert graph.chosen != choice.INDUCTOR and "inductor (disagrees with eager: output or gradient 0" in graph.choice


def test_disagreement_names_non_finite_and_far_values():
    half = choice.summary([torch.ones(4, dtype=torch.bfloat16)])
    assert choice.disagreement(choice.summary([torch.ones(4, dtype=torch.bfloat16) * 1.2]), half) == ""
    assert "norm" in choice.disagreement(choice.summary([torch.ones(4, dtype=torch.bfloat16) * 1.5]), half)
    want = choice.summary([torch.ones(4), torch.ones(3)])
    assert choice.disagreement(choice.summary([torch.ones(4), torch.ones(3) * 1.01]), want) == ""
    nan = torch.tensor([1.0, float("nan"), 1])
    assert "not finite" in choice.disagreement(choice.summary([torch.ones(4), nan]), want)
    assert "norm" in choice.disagreement(choice.summary([torch.ones(4) * 2, torch.ones(3)]), want)
    assert "outputs and gradients" in choice.disagreement(choice.summary([torch.ones(4)]), want)


def test_every_candidate_gets_the_same_output_gradients():
    """The candidates' gradients are compared: the output gradients a measurement sends must be
    the same for each."""
    w = torch.randn(8, 8, requires_grad=True)
    runs = [choice.runner(lambda w: [w @ w], [w], training=True) for _ in range(2)]
    first, second = (run() for run in runs)
    torch.testing.assert_close(first[1], second[1])


def test_a_train_step_times_every_candidate(choosing):
    """Real measurement of a train step: every candidate agrees with eager and is timed."""
    model, x = Block(), torch.randn(16, 32)
    compiled = torch.compile(model, backend="xaccel")
    _check_against_eager(compiled, model, x)
    entry, = [json.loads(p.read_text())["value"] for p in _choice_entries(choosing)]
    assert [name for name, ms, why in entry["timings"] if ms is None] == []
    assert sorted(name for name, _, _ in entry["timings"]) == sorted(NAMES)


def test_region_sides_reading_different_inputs_compare_the_gradients_they_share():
    """A replacement may read a survivor its original computes for itself (a weight, where the
    original reads the weight's transpose): gradients are compared for the inputs both sides read,
    a timed backward still covers every input."""
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    wt = w.detach().t().contiguous().requires_grad_()
    replaced = choice.runner(lambda x, w: F.linear(x, w).relu(), [x, w], True, compared=[0])
    written = choice.runner(lambda wt, x: (x @ wt).relu(), [wt, x], True, compared=[1])
    got, want = replaced(), written()
    assert len(got) == len(want) == 2  # the output and x's gradient
    assert not choice.disagreement(choice.summary(got), choice.summary(want))
    # without the selection each side's second gradient is a different input's
    assert len(choice.runner(lambda x, w: F.linear(x, w).relu(), [x, w], True)()) == 3


def test_a_lowered_graph_with_regions_put_back_keeps_its_outputs_through_the_backward(xaccel_env, tmp_path,
                                                                                      monkeypatch):
    """transformers' xLSTM train step with its skinny linears and two of each block's GEMM chains put
    back: under Inductor its backward must not write into the logits it returned (aot_autograd's
    donated buffers did), so the xaccel candidate agrees with eager and is measured."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.xlstm import modeling_xlstm

    xaccel_env(XACCEL_CHOOSE="1", XACCEL_CACHE_DIR=str(tmp_path))

    def put_back_some(diff, example_inputs, training, rests, *args):
        chosen = [r for k, r in enumerate(diff.regions) if k % 5 in (0, 1, 3)]  # per block: skinny, 1st, 3rd GEMM
        return {rest: chosen for rest in rests}, []
    monkeypatch.setattr(choice, "choose_regions", put_back_some)
    cfg = transformers.xLSTMConfig(vocab_size=97, hidden_size=64, num_heads=2, num_blocks=2, qk_dim_factor=0.5,
                                   v_dim_factor=1.0, chunk_size=16, mode="train", use_cache=False)
    torch.manual_seed(0)
    model = modeling_xlstm.xLSTMForCausalLM(cfg).train()
    ids = torch.randint(0, 97, (2, 32))
    torch._dynamo.reset()
    out = torch.compile(model, backend="xaccel")(input_ids=ids, labels=ids)
    out.loss.backward()
    [graph] = last_report().graphs
    assert graph.region_choices == [] and "xaccel (inductor rest)" in graph.choice, graph.choice
    assert "disagrees" not in graph.choice, graph.choice
