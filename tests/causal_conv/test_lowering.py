"""The causal_conv pass: a causal depthwise conv1d in either form causal code takes (padded on both
sides and cut to the first S outputs, or fed a left-padded input), with and without bias, and the
xlstm package's CausalConv1d inside its blocks, become xaccel.causal_conv1d, equal to eager in
forward and gradients (fp32); convolutions that are not causal and depthwise, and a switched-off
pattern, are left as written."""
import pytest
import torch
import torch.nn.functional as F

from tests.causal_conv import xlstm_stack
from tests.helpers import check_compiled


def _w(*shape):
    return torch.randn(*shape, requires_grad=True)


def cut(x, w, b):  # the xlstm package's form: [B, S, C] in and out
    K = w.shape[-1]
    return F.conv1d(x.transpose(1, 2), w, b, padding=K - 1, groups=w.shape[0])[..., :-(K - 1)].transpose(1, 2)


def cut_to_length(x, w, b):
    S, K = x.shape[-1], w.shape[-1]
    return F.conv1d(x, w, b, padding=K - 1, groups=w.shape[0])[:, :, :S].sin()


def left_padded(x, w, b):  # Mamba-style
    return F.silu(F.conv1d(F.pad(x, (w.shape[-1] - 1, 0)), w, b, groups=w.shape[0]))


FORMS = {"cut, transposed activation": (cut, lambda: (_w(2, 13, 6), _w(6, 1, 4), _w(6))),
         "cut to S, no bias": (cut_to_length, lambda: (_w(3, 5, 9), _w(5, 1, 3), None)),
         "left-padded input": (left_padded, lambda: (_w(2, 7, 11), _w(7, 1, 2), _w(7)))}


@pytest.mark.parametrize("form", FORMS)
def test_each_form_is_one_causal_conv_equal_to_eager(form):
    fn, make = FORMS[form]
    torch.manual_seed(0)
    x, w, b = make()
    if b is None:
        report = check_compiled(lambda x, w: fn(x, w, None), (x, w))
    else:
        report = check_compiled(fn, (x, w, b))
    assert report.counts()["causal_conv"] == 1, str(report)


def test_a_view_of_the_output_still_works():
    """Users that view the convolution's output in a way its own layout allowed (here merging batch
    and channels, which the op's channels-innermost output would not allow) get a contiguous copy."""
    torch.manual_seed(4)

    def viewed(x, w):
        y = F.conv1d(F.pad(x, (3, 0)), w, groups=6)
        return y.view(-1, y.shape[-1]).cos() + y.transpose(1, 2).reshape(-1, 6).sum()
    report = check_compiled(viewed, (_w(2, 6, 10), _w(6, 1, 4)))
    assert report.counts()["causal_conv"] == 1, str(report)


def test_dynamic_sequence_length():
    """One dynamic compile (sizes symbolic, the cut -(K - 1) a symbolic expression) serves a second
    sequence length without recompiling, equal to eager at both."""
    torch.manual_seed(1)
    report = check_compiled(cut, (_w(2, 9, 4), _w(4, 1, 4), _w(4)), dynamic=True)
    assert report.counts()["causal_conv"] == 1, str(report)
    again = check_compiled(cut, (_w(3, 14, 4), _w(4, 1, 4), _w(4)), dynamic=True)
    assert not again.graphs, "recompiled for a new length"


def test_convolutions_that_are_not_causal_and_depthwise_are_left_as_written():
    torch.manual_seed(2)
    x = _w(2, 6, 10)
    cases = [
        (lambda x, w: F.conv1d(x, w, padding=3, groups=6)[..., 3:], (x, _w(6, 1, 4))),  # anti-causal cut
        (lambda x, w: F.conv1d(x, w, padding=3, groups=6), (x, _w(6, 1, 4))),  # no cut
        (lambda x, w: F.conv1d(x, w, padding=3, groups=2)[..., :-3], (x, _w(6, 3, 4))),  # grouped, not depthwise
        (lambda x, w: F.conv1d(F.pad(x, (2, 1)), w, groups=6), (x, _w(6, 1, 4))),  # padded on both sides
        (lambda x, w: F.conv1d(x, w, padding=6, dilation=2, groups=6)[..., :-6], (x, _w(6, 1, 4))),  # dilated
        (lambda x, w: F.conv1d(F.pad(x, (3, 0), mode="replicate"), w, groups=6), (x, _w(6, 1, 4))),  # not zeros
        (lambda x, w: F.conv1d(F.pad(x, (3, 0), value=1.0), w, groups=6), (x, _w(6, 1, 4))),  # padded with ones
    ]
    for fn, inputs in cases:
        report = check_compiled(fn, inputs)
        assert report.counts()["causal_conv"] == 0 and not any(f.family == "causal_conv" for f in report.fallbacks), \
            str(report)


def test_switched_off_by_patterns(monkeypatch):
    monkeypatch.setenv("XACCEL_PATTERNS", "gemm_epilogue")
    report = check_compiled(cut, (_w(2, 9, 4), _w(4, 1, 4), _w(4)))
    assert report.counts()["causal_conv"] == 0


def test_xlstm_block_stack_convolutions_replaced_equal_to_eager():
    """The xlstm package's xLSTMBlockStack with an mLSTM and an sLSTM block (each with its
    CausalConv1d, kernel size 4): both convolutions replaced, forward and every parameter's
    gradient within 1e-5 of eager."""
    pytest.importorskip("xlstm")
    torch.manual_seed(3)
    model = xlstm_stack(32, 24)
    params = list(model.parameters())
    report = check_compiled(lambda x, *p: model(x), (_w(2, 24, 32), *params))
    assert report.counts()["causal_conv"] == 2, str(report)


def test_refusal_names_what_the_kernels_lack_on_cuda():
    """Fake CUDA values (no GPU needed): fp64 and a kernel size above the kernels' limit are
    reported and left as written; bf16 at kernel size 4 is taken; CPU values are never refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_xaccel.lowering.causal_conv.conv1d import _Match, _refusal

    graph = torch.fx.Graph()

    def node(t):
        n = graph.placeholder(f"t{len(graph.nodes)}")
        n.meta["val"] = t
        return n

    def refusal(device, dtype, K):
        with FakeTensorMode():
            x = torch.empty(2, 8, 64, device=device, dtype=dtype)
            w = torch.empty(8, 1, K, device=device, dtype=dtype)
        return _refusal(_Match(node(x), node(w), None, K, []))
    assert "no causal_conv1d kernel for torch.float64" in refusal("cuda", torch.float64, 4)
    assert "kernel size 32" in refusal("cuda", torch.bfloat16, 32)
    assert refusal("cuda", torch.bfloat16, 4) is None and refusal("cpu", torch.float64, 32) is None
