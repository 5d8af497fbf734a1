"""The skinny_linear pass: gate projections (linears of one input with few outputs), over a
concatenation or not, with and without biases, and the xlstm package's mLSTM gates inside its
block stack become xaccel.skinny_linear, equal to eager in forward and gradients (fp32); wide
linears, a switched-off pattern and decode-size rows on CUDA are left to others."""
import pytest
import torch
import torch.nn.functional as F

from tests.causal_conv import xlstm_stack
from tests.helpers import check_compiled


def _w(*shape):
    return torch.randn(*shape, requires_grad=True)


def _gates(q, k, v, wi, bi, wf, bf):  # the xlstm package's mLSTM cell
    x = torch.cat([q, k, v], dim=-1)
    return F.linear(x, wi, bi).transpose(-1, -2).sigmoid(), F.linear(x, wf, bf).exp()


def test_gates_over_a_concatenation_are_one_op_equal_to_eager():
    torch.manual_seed(0)
    report = check_compiled(_gates, (_w(2, 9, 16), _w(2, 9, 16), _w(2, 9, 24), _w(4, 56), _w(4), _w(4, 56), _w(4)))
    assert report.counts()["skinny_linear"] == 1 and report.counts()["gemm_epilogue"] == 0, str(report)


def test_linears_of_one_input_without_concatenation_or_bias():
    torch.manual_seed(1)
    report = check_compiled(lambda x, a, b: F.linear(x, a) * F.linear(x, b), (_w(3, 7, 40), _w(8, 40), _w(8, 40)))
    assert report.counts()["skinny_linear"] == 1, str(report)


def test_a_lone_linear_of_a_plain_input_is_left_to_gemm_epilogue():
    torch.manual_seed(5)
    report = check_compiled(lambda x, a: F.linear(x.relu(), a).sigmoid(), (_w(11, 33), _w(3, 33)))
    assert report.counts()["skinny_linear"] == 0 and report.counts()["gemm_epilogue"] == 1, str(report)


def test_outputs_past_the_limit_split_into_groups_and_wide_linears_are_left():
    torch.manual_seed(2)
    four = lambda x, a, b, c, d: F.linear(x, a) + F.linear(x, b) - F.linear(x, c) * F.linear(x, d)  # noqa: E731
    report = check_compiled(four, (_w(5, 20), _w(8, 20), _w(8, 20), _w(8, 20), _w(8, 20)))
    assert report.counts()["skinny_linear"] == 2, str(report)
    report = check_compiled(lambda x, a: F.linear(x, a).tanh(), (_w(5, 20), _w(32, 20)))
    assert report.counts()["skinny_linear"] == 0


def test_gates_of_gates_read_the_first_groups_output():
    """A second group whose input is a linear the first group replaced reads the op's slice."""
    torch.manual_seed(6)

    def fn(x, a, b, c, d):
        g = F.linear(x, a)
        return F.linear(g, c) * F.linear(g, d) + F.linear(x, b).sum(-1, keepdim=True)
    report = check_compiled(fn, (_w(3, 10), _w(6, 10), _w(6, 10), _w(3, 6), _w(3, 6)))
    assert report.counts()["skinny_linear"] == 2, str(report)


def test_concatenation_read_elsewhere_is_kept():
    torch.manual_seed(3)

    def fn(a, b, w):
        x = torch.cat([a, b], -1)
        return F.linear(x, w), x.square()
    report = check_compiled(fn, (_w(4, 6, 5), _w(4, 6, 7), _w(2, 12)))
    assert report.counts()["skinny_linear"] == 1


def test_switched_off_by_patterns(monkeypatch):
    monkeypatch.setenv("XACCEL_PATTERNS", "gemm_epilogue")
    report = check_compiled(lambda x, a: F.linear(x, a), (_w(4, 8), _w(2, 8)))
    assert report.counts()["skinny_linear"] == 0


def test_xlstm_block_stack_mlstm_gates_replaced_equal_to_eager():
    """The mLSTM cell's igate and fgate of cat(q, k, v): one op, forward and every parameter's
    gradient within 1e-5."""
    pytest.importorskip("xlstm")
    torch.manual_seed(4)
    model = xlstm_stack(32, 24)
    report = check_compiled(lambda x, *p: model(x), (_w(2, 24, 32), *model.parameters()))
    assert report.counts()["skinny_linear"] == 1, str(report)
    assert any("concatenation of 3 inputs" in r.pattern for r in report.replacements if r.family == "skinny_linear")


def test_decode_rows_on_cuda_are_reported_and_left_to_cublas():
    """Fake CUDA values (no GPU needed): 8 rows are left as written with the reason; 4096 taken."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_xaccel.lowering.skinny_linear.shared_input import _refusal

    graph = torch.fx.Graph()

    def node(t):
        n = graph.placeholder(f"t{len(graph.nodes)}")
        n.meta["val"] = t
        return n

    def refusal(rows):
        with FakeTensorMode():
            x = torch.empty(rows, 64, device="cuda", dtype=torch.bfloat16)
            w = torch.empty(4, 64, device="cuda", dtype=torch.bfloat16)
        return _refusal([node(x)], [w], [])
    assert "8 rows" in refusal(8) and refusal(4096) is None
