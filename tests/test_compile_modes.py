"""torch.compile's mode= and options= reach the xaccel backend (modes.py): known modes become the
rest's settings, unknown ones raise, Inductor-only settings under the eager fallback warn."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import inductor_patches
from torch_xaccel.errors import XaccelConfigError
from torch_xaccel.report import Report, collect


def fn(x, w, b):
    return F.gelu(F.linear(x, w, b)) + x[:, :1]


def _compile_and_check(**kwargs):
    x, w, b = torch.randn(16, 8), torch.randn(12, 8), torch.randn(12)
    torch._dynamo.reset()
    with collect() as graphs:
        out = torch.compile(fn, backend="xaccel", **kwargs)(x, w, b)
    torch.testing.assert_close(out, fn(x, w, b), rtol=1e-5, atol=1e-6)
    return Report(graphs=graphs)


def test_reduce_overhead_runs_the_eager_rest_through_cuda_graph_trees():
    """On CPU the graph trees refuse (CPU tensors) and say so: the count of refusals proves the
    lowered graph went their way; the result still matches and the op is still replaced."""
    from torch._dynamo.utils import counters

    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. "static-parameter CUDA graphs unavailable"
        report = _compile_and_check(mode="reduce-overhead")
    assert report.counts()["gemm_epilogue"] == 1
    assert counters["inductor"]["cudagraph_skips"] >= 1
    assert "mode=reduce-overhead: the rest of the graph eagerly under CUDA graphs" in str(report)


def test_default_mode_adds_nothing():
    from torch._dynamo.utils import counters

    counters.clear()
    report = _compile_and_check()
    assert report.graphs[0].settings == "" and "mode=" not in str(report)
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_settings_line_only_where_the_settings_apply(xaccel_env):
    """XACCEL_DISABLE=1 runs the captured graph as is: no settings line; Inductor-only settings
    under the eager rest are reported as ignored."""
    with pytest.warns(UserWarning):
        report = _compile_and_check(mode="max-autotune-no-cudagraphs")
    assert "mode=max-autotune-no-cudagraphs: ignored" in str(report)
    xaccel_env(XACCEL_DISABLE="1")
    report = _compile_and_check(mode="reduce-overhead")
    assert report.graphs[0].disabled and report.graphs[0].settings == "" and "mode=" not in str(report)


def test_inductor_only_settings_under_the_eager_fallback_warn():
    with pytest.warns(UserWarning, match="max_autotune.*only apply to Inductor"):
        _compile_and_check(mode="max-autotune-no-cudagraphs")


def test_options_reach_inductor_under_the_inductor_fallback(xaccel_env, monkeypatch):
    """With XACCEL_FALLBACK=inductor the patches go to compile_fx as they are (plus the no-op pass
    that keys Inductor's caches by the xaccel ops, torch_xaccel/inductor_cache.py)."""
    seen = inductor_patches(monkeypatch)
    xaccel_env(XACCEL_FALLBACK="inductor")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing is ignored here
        _compile_and_check(options={"epilogue_fusion": False})
    assert seen and {k: v for k, v in seen[0].items() if k != "post_grad_custom_pre_pass"} == {"epilogue_fusion": False}
    assert type(seen[0]["post_grad_custom_pre_pass"]).__name__ == "XaccelOpsKey"


def test_static_inputs_without_aot_metadata_are_the_marked_tensors():
    """Outside a trace (no aot_autograd list) the tensors Dynamo marked, or parameters, are kept;
    indices count aot_autograd's lifted arguments first."""
    from torch_xaccel.graphed_rest import static_inputs

    p, x, b = torch.nn.Parameter(torch.randn(3)), torch.randn(3), torch.randn(3)
    b._dynamo_static_input_type = "unguarded"
    assert static_inputs([x, p, 4, b], 4) == [1, 3]
    assert static_inputs([x, p], 3) == [0, 2]  # one lifted argument in front


def test_graphed_rest_runner_empties_its_argument_list():
    """The graph trees call the graph boxed and assert afterwards that the argument list is empty
    (make_boxed_func leaves it full, which fails that assertion at the first replay)."""
    from torch_xaccel.graphed_rest import boxed_clearing

    gm = torch.fx.symbolic_trace(lambda a, b: torch.tanh(a) * b)
    a, b = torch.randn(5), torch.randn(5)
    args = [a, b]
    out = boxed_clearing(gm)(args)
    assert args == [] and getattr(boxed_clearing(gm), "_boxed_call", False)
    torch.testing.assert_close(out, torch.tanh(a) * b, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="fastest"), "unknown mode='fastest'"),
    (dict(options={"no_such_knob": True}), "unknown option 'no_such_knob'"),
    (dict(options={"max_autotune": "yes"}), "option 'max_autotune' takes a bool, got str"),
])
def test_unknown_mode_or_option_raises(kwargs, match):
    from torch_xaccel.modes import rest_options

    with pytest.raises(XaccelConfigError, match=match):
        rest_options(kwargs)
    with pytest.raises(XaccelConfigError, match=match):  # through torch.compile the same error reaches the user
        _compile_and_check(**kwargs)


def test_modes_known_to_inductor_are_accepted():
    from torch._inductor import list_mode_options

    from torch_xaccel.modes import CUDAGRAPHS, rest_options

    for mode in list_mode_options():
        assert rest_options(dict(mode=mode)) == list_mode_options(mode)
    assert rest_options(dict(mode="reduce-overhead"))[CUDAGRAPHS] is True


def test_graphed_rest_keeps_parameters_static():
    """Under reduce-overhead without autograd, the inputs the graph trees keep in place are the
    module's parameters (Dynamo's marks on them), not only the lifted arguments, which is all that
    torch's own cudagraphs backend keeps (it copies every weight on each replay). Checked through
    the index helper while a module compiles (on CPU the trees themselves skip)."""
    from torch_xaccel import graphed_rest

    seen = []
    real = graphed_rest.static_inputs

    def spy(example_inputs, n_aot):
        seen.append((real(example_inputs, n_aot), n_aot, list(example_inputs)))
        return seen[-1][0]
    lin = torch.nn.Linear(8, 12)
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphed_rest, "static_inputs", spy)
        x = torch.randn(16, 8)
        with torch.no_grad():
            out = torch.compile(lambda x: F.gelu(lin(x)) + 1, backend="xaccel", mode="reduce-overhead")(x)
            torch.testing.assert_close(out, F.gelu(lin(x)) + 1, rtol=1e-5, atol=1e-6)
    assert seen, "the graphed inference path was not taken"
    static, n_aot, inputs = seen[0]
    lifted = n_aot - len(inputs)
    kept = [inputs[i - lifted] for i in static if i >= lifted]
    assert len(kept) == 2 and {id(t) for t in kept} == {id(lin.weight), id(lin.bias)}  # x is copied in, not kept
    assert static == list(range(lifted)) + sorted(i for i in static if i >= lifted)


def test_inductor_rest_sees_the_parameters_as_static(xaccel_env, monkeypatch):
    """The lowered graph carries Dynamo's metadata (backend._carry_dynamo_metadata), so Inductor
    keeps a module's weights in place under CUDA graphs, as it does without xaccel (on the
    lowered graph alone it finds no static input and copies every weight on each replay)."""
    import torch._inductor.compile_fx as cfx

    if not hasattr(cfx, "get_static_input_idxs"):
        pytest.skip("this torch has no get_static_input_idxs")
    seen = []
    real = cfx.get_static_input_idxs
    monkeypatch.setattr(cfx, "get_static_input_idxs", lambda n: seen.append(real(n)) or seen[-1])
    xaccel_env(XACCEL_FALLBACK="inductor")
    lin = torch.nn.Linear(8, 12)
    x = torch.randn(16, 8)
    torch._dynamo.reset()
    # compiled afresh: a cache hit (an earlier run's graph) would not ask for the static inputs
    with torch.no_grad(), collect() as graphs, torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        out = torch.compile(lambda x: F.gelu(lin(x)) + 1, backend="xaccel", mode="reduce-overhead")(x)
    torch.testing.assert_close(out, F.gelu(lin(x)) + 1, rtol=1e-5, atol=1e-6)
    assert Report(graphs=graphs).counts()["gemm_epilogue"] == 1
    assert seen and len(seen[0]) == 2, seen  # weight and bias
