"""Backward graphs: an activation's gradient and a residual's gradient fuse into the GEMM before
them (lowering/gemm_epilogue/backward.py, XACCEL_BACKWARD_FUSION=1); gradients still equal eager's."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import check_compiled, rel_err
from torch_xaccel import config
from torch_xaccel.codegen.gemm_epilogue import cutlass_kernels
from torch_xaccel.lowering.gemm_epilogue import backward
from torch_xaccel.ops.gemm_epilogue.epilogue_ir import GRAD, Epilogue, evaluate
from torch_xaccel.report import Report, collect

ACTS = {"gelu_tanh_grad": lambda h: F.gelu(h, approximate="tanh"), "gelu_grad": F.gelu, "silu_grad": F.silu,
        "sigmoid_grad": torch.sigmoid, "tanh_grad": torch.tanh, "relu_grad": F.relu}


@pytest.fixture(autouse=True)
def _backward_fusion_on(monkeypatch):
    monkeypatch.setenv("XACCEL_BACKWARD_FUSION", "1")


def _backward_patterns(report: Report) -> list[str]:
    return [r.pattern for r in report.replacements if "backward" in r.note]


@pytest.mark.parametrize("grad_op", GRAD)
@pytest.mark.parametrize("lead", [(), (3,)])
def test_mlp_backward_fuses_activation_and_residual_gradients(grad_op, lead):
    torch.manual_seed(len(lead) + GRAD.index(grad_op))
    act = ACTS[grad_op]

    def block(x, w1, b1, w2, b2):
        return F.linear(act(F.linear(x, w1, b1)), w2, b2) + x

    leaves = [torch.randn(*shape, requires_grad=True) for shape in ((*lead, 17, 24), (40, 24), (40,), (24, 40), (24,))]
    report = check_compiled(block, leaves)  # forward and every gradient (x, both weights, both biases) vs eager
    gemm = "matmul" if lead else "mm"  # a 3-D gradient reaches the pass as view -> mm -> view, folded back
    assert sorted(_backward_patterns(report)) == sorted([f"{gemm} -> {grad_op}(full)", f"{gemm} -> add(full)"])


@pytest.mark.parametrize("setting", ["0", None])
def test_backward_fusion_off_leaves_backward_as_traced(monkeypatch, setting):
    """Off explicitly, and by default where no CUTLASS kernel can run (with the Triton kernels
    alone it loses to cuBLAS: lowering/gemm_epilogue/backward.backward_pass)."""
    if setting is None:
        monkeypatch.delenv("XACCEL_BACKWARD_FUSION", raising=False)
        monkeypatch.setattr(cutlass_kernels, "available", lambda: False)
    else:
        monkeypatch.setenv("XACCEL_BACKWARD_FUSION", setting)
    torch.manual_seed(0)
    up, down = nn.Linear(16, 32), nn.Linear(32, 16)
    report = check_compiled(lambda x: down(F.gelu(up(x))) + x, (torch.randn(9, 16, requires_grad=True),))
    assert _backward_patterns(report) == []
    assert report.counts()["gemm_epilogue"] == 2  # the forward is unchanged


@pytest.mark.parametrize("cutlass, mode, on",
                         [(True, "", True), (True, "wait", True), (True, "0", False), (False, "", False)])
def test_default_follows_cutlass_availability(monkeypatch, cutlass, mode, on):
    monkeypatch.delenv("XACCEL_BACKWARD_FUSION", raising=False)
    monkeypatch.setenv("XACCEL_CUTLASS", mode)
    monkeypatch.setattr(cutlass_kernels, "available", lambda: cutlass)
    assert (backward.backward_pass(config.load()) is not None) is on
    monkeypatch.setenv("XACCEL_BACKWARD_FUSION", "0")
    assert backward.backward_pass(config.load()) is None


def test_grad_ops_evaluate_to_the_activation_derivative():
    """Each gradient op of the IR, in float64, equals autograd's derivative of its activation times g;
    sigmoid and tanh take the activation's output, the others its input."""
    torch.manual_seed(0)
    x = torch.randn(64, dtype=torch.float64) * 3
    g = torch.randn(64, dtype=torch.float64)
    for op in GRAD:
        xr = x.clone().requires_grad_()
        y = ACTS[op](xr)
        (want,) = torch.autograd.grad(y, xr, g)
        arg = y.detach() if op in ("sigmoid_grad", "tanh_grad") else x
        ep = Epilogue(({"op": "acc", "index": 0}, {"op": "load", "operand": 0, "bcast": "full"},
                       {"op": op, "in": [0, 1]}), (2,))
        got = evaluate(ep, [g], [arg], dtype=torch.float64)[2]
        assert rel_err(got, want) < 1e-12, op


def test_a_grad_op_in_a_training_forward_graph_is_not_fused():
    """A graph that trains keeps gradient ops out of chains: the IR has no second derivatives."""
    def fn(x, w, pre):
        return torch.ops.aten.gelu_backward(x @ w.t(), pre, approximate="tanh")

    torch.manual_seed(0)
    report = check_compiled(fn, (torch.randn(8, 16, requires_grad=True), torch.randn(12, 16, requires_grad=True),
                                 torch.randn(8, 12, requires_grad=True)))
    assert not any("grad" in r.pattern for r in report.replacements)


def test_a_failing_backward_pass_is_reported_and_the_backward_runs_as_traced(monkeypatch):
    from torch_xaccel.lowering.gemm_epilogue import backward

    def broken(gm, report, cfg):
        mm = next(iter(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default)))
        mm.target = torch.ops.aten.sub.Tensor  # leaves the graph half-edited (wrong values if it ran), then fails
        gm.recompile()
        raise RuntimeError("synthetic")

    monkeypatch.setattr(backward, "run", broken)
    torch.manual_seed(0)
    up, down = nn.Linear(16, 32), nn.Linear(32, 16)
    with pytest.warns(Warning, match="backward pass failed"):
        report = check_compiled(lambda x: down(F.gelu(up(x))) + x, (torch.randn(9, 16, requires_grad=True),))
    assert any("backward graph: RuntimeError: synthetic" in f.reason for f in report.fallbacks), str(report)
    assert _backward_patterns(report) == []


def test_backward_replacements_reach_the_forward_graphs_report():
    torch.manual_seed(0)
    up, down = nn.Linear(16, 32), nn.Linear(32, 16)
    x = torch.randn(9, 16, requires_grad=True)
    with collect() as graphs:
        out = torch.compile(lambda x: down(F.silu(up(x))) + x, backend="xaccel")(x)
        assert _backward_patterns(Report(graphs=graphs)) == []  # compiled at the first backward call
        out.sum().backward()
    assert sorted(_backward_patterns(Report(graphs=graphs))) == ["mm -> add(full)", "mm -> silu_grad(full)"]
    assert "[backward]" in str(Report(graphs=graphs))
