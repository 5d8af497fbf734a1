"""The headwise pass: einsums that apply one small linear map per head, written in any letters and
orders (and the xlstm package's LinearHeadwiseExpand), become xaccel.headwise, equal to eager in
forward and gradients (fp32); other einsums, large blocks and a switched-off pattern are left as
written."""
import pytest
import torch

from tests.helpers import check_compiled


def _w(*shape):
    return torch.randn(*shape, requires_grad=True)


FORMS = {
    "xlstm": ("...hd,hod->...ho", lambda: (_w(2, 9, 6, 4), _w(6, 4, 4))),
    "weight first, d before h": ("hdo,bsdh->bsoh", lambda: (_w(6, 3, 5), _w(2, 7, 3, 6))),
    "output order swapped": ("bhd,hod->boh", lambda: (_w(5, 3, 2), _w(3, 7, 2))),
    "odd sizes, no batch": ("hd,hod->ho", lambda: (_w(7, 3), _w(7, 5, 3))),
}


@pytest.mark.parametrize("form", FORMS)
def test_each_form_is_one_headwise_op_equal_to_eager(form):
    equation, make = FORMS[form]
    torch.manual_seed(0)
    inputs = make()
    report = check_compiled(lambda a, b: torch.einsum(equation, a, b).sin(), inputs)
    assert report.counts()["headwise"] == 1, str(report)


def test_odd_batch_and_dynamic_batch():
    torch.manual_seed(1)
    for B in (3, 5):
        report = check_compiled(lambda x, w: torch.einsum("bshd,hod->bsho", x, w), (_w(B, 11, 4, 2), _w(4, 3, 2)),
                                dynamic=True)
        assert report.counts()["headwise"] == 1, str(report)


def test_xlstm_linear_headwise_expand_module():
    pytest.importorskip("xlstm")
    from xlstm.components.linear_headwise import LinearHeadwiseExpand, LinearHeadwiseExpandConfig

    torch.manual_seed(2)
    layer = LinearHeadwiseExpand(LinearHeadwiseExpandConfig(in_features=32, num_heads=8, bias=True))
    with torch.no_grad():
        layer.bias.normal_()
    x = _w(2, 13, 32)
    params = list(layer.parameters())
    report = check_compiled(lambda x, *p: layer(x), (x, *params))
    assert report.counts()["headwise"] == 1, str(report)


def test_other_einsums_and_large_blocks_are_left_as_written():
    torch.manual_seed(3)
    q, k = _w(2, 3, 5, 4), _w(2, 3, 5, 4)
    report = check_compiled(lambda q, k: torch.einsum("bhsd,bhtd->bhst", q, k), (q, k))  # attention scores
    assert report.counts()["headwise"] == 0 and not report.fallbacks, str(report)
    report = check_compiled(lambda x, w: torch.einsum("bhd,hod->bho", x, w), (_w(2, 2, 24), _w(2, 24, 24)))
    assert report.counts()["headwise"] == 0 and not report.fallbacks, str(report)  # a GEMM's job


def test_switched_off_by_patterns(monkeypatch):
    monkeypatch.setenv("XACCEL_PATTERNS", "gemm_epilogue")
    report = check_compiled(lambda x, w: torch.einsum("bhd,hod->bho", x, w), (_w(2, 3, 4), _w(3, 4, 4)))
    assert report.counts()["headwise"] == 0


def test_compiled_training_graphs_call_the_op_bodies_directly(monkeypatch):
    """Forward and backward graphs call the ops' bodies (ops.DIRECT_CALLS), not the custom-op
    dispatcher: a small projection's host time. Results equal eager."""
    from torch_xaccel import ops
    from torch_xaccel.ops.headwise import op

    calls = []

    def counted(fn):
        def call(*args):
            calls.append(fn.__name__)
            return fn(*args)
        return call
    for overload, fn in ((torch.ops.xaccel.headwise.default, op.run),
                         (torch.ops.xaccel.headwise_weight_grad.default, op.run_weight_grad)):
        assert ops.DIRECT_CALLS.get(overload) is fn
        monkeypatch.setitem(ops.DIRECT_CALLS, overload, counted(fn))
    torch.manual_seed(4)
    report = check_compiled(lambda x, w: torch.einsum("bhd,hod->bho", x, w), (_w(3, 5, 4), _w(5, 4, 4)))
    assert report.counts()["headwise"] == 1
    assert sorted(calls) == ["run", "run", "run_weight_grad"], calls
