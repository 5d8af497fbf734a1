"""An all-zero initial state built in the graph (the xlstm cell's default) is dropped from the
sLSTM op, which then runs its no-state path; a given state is kept. Results equal eager."""
import torch

from tests.helpers import rel_err
from tests.slstm.test_saving import _layer
from torch_xaccel.lowering.slstm import zero_state


def _compile_counting(monkeypatch, fn, *args):
    seen = []
    run = zero_state.run

    def counting(gm):
        seen.append(run(gm))
        return seen[-1]
    monkeypatch.setattr(zero_state, "run", counting)
    torch._dynamo.reset()
    return torch.compile(fn, backend="xaccel")(*args), seen


def test_default_zero_state_is_dropped(monkeypatch):
    layer = _layer()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        got, seen = _compile_counting(monkeypatch, layer, x)
        assert rel_err(got, layer(x)) < 1e-5
    assert seen == [1]


def test_given_state_is_kept(monkeypatch):
    layer = _layer()
    x = torch.randn(2, 5, 32)
    state = torch.randn(4, 2, 32)
    state[2] = state[2].abs() + 0.5
    with torch.no_grad():
        got, seen = _compile_counting(monkeypatch, lambda x, s: layer(x, slstm_state=s), x, state)
        assert rel_err(got, layer(x, slstm_state=state)) < 1e-5
    assert seen == [0]


def test_a_zero_state_written_in_place_is_kept():
    g = torch.fx.Graph()
    z = g.call_function(torch.ops.aten.zeros.default, ([2, 2, 3],))
    g.call_function(torch.ops.aten.fill_.Scalar, (z, 1.0))
    parts = [g.call_function(torch.ops.aten.select.int, (z, 0, 0)) for _ in range(4)]
    wx, r, b = (g.placeholder(n) for n in ("wx", "r", "b"))
    op = g.call_function(torch.ops.xaccel.slstm.default, (wx, r, b, *parts, "batch", True, False))
    g.output(op)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert zero_state.run(gm) == 0
