"""The group_norm pass: group norms of rows [N, C], with and without weight and bias, and the
xlstm package's MultiHeadLayerNorm inside its blocks, become xaccel.group_norm, equal to eager in
forward and gradients (fp32); group norms of [N, C, L] inputs and a switched-off pattern are left
as written."""
import pytest
import torch
import torch.nn.functional as F

from tests.causal_conv import xlstm_stack
from tests.helpers import check_compiled


def _w(*shape):
    return torch.randn(*shape, requires_grad=True)


def test_row_group_norm_with_and_without_affine_is_one_op_equal_to_eager():
    torch.manual_seed(0)
    for fn, inputs in ((lambda x, w, b: F.group_norm(x, 4, w, b).sin(), (_w(9, 32), _w(32), _w(32))),
                       (lambda x, w: F.group_norm(x * 2, 3, w, eps=1e-3), (_w(5, 12), _w(12))),
                       (lambda x: F.group_norm(x.view(-1, 24), 6), (_w(2, 3, 24),))):
        report = check_compiled(fn, inputs)
        assert report.counts()["group_norm"] == 1, str(report)


def test_group_norm_of_channels_and_positions_is_left_as_written():
    torch.manual_seed(1)
    report = check_compiled(lambda x, w: F.group_norm(x, 2, w), (_w(3, 8, 10), _w(8)))
    assert report.counts()["group_norm"] == 0 and not any(f.family == "group_norm" for f in report.fallbacks)


def test_switched_off_by_patterns(monkeypatch):
    monkeypatch.setenv("XACCEL_PATTERNS", "gemm_epilogue")
    report = check_compiled(lambda x: F.group_norm(x, 2), (_w(4, 8),))
    assert report.counts()["group_norm"] == 0


def test_xlstm_block_stack_head_norms_replaced_equal_to_eager():
    """The mLSTM and the sLSTM block each normalize their heads with MultiHeadLayerNorm (a group
    norm of [B * S, NH * DH]): both replaced, forward and every parameter's gradient within 1e-5."""
    pytest.importorskip("xlstm")
    torch.manual_seed(2)
    model = xlstm_stack(32, 24)
    report = check_compiled(lambda x, *p: model(x), (_w(2, 24, 32), *model.parameters()))
    assert report.counts()["group_norm"] == 2, str(report)


def test_refusal_names_what_the_kernels_lack_on_cuda():
    """Fake CUDA values (no GPU needed): fp64 is reported and left as written, bf16 taken; CPU
    values are never refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_xaccel.lowering.group_norm.rows import _refusal

    graph = torch.fx.Graph()

    def node(t):
        n = graph.placeholder(f"t{len(graph.nodes)}")
        n.meta["val"] = t
        return n

    def refusal(device, dtype):
        with FakeTensorMode():
            x, w = torch.empty(64, 32, device=device, dtype=dtype), torch.empty(32, device=device, dtype=dtype)
        return _refusal(node(x), node(w), None, 4)
    assert "no group_norm kernel for torch.float64" in refusal("cuda", torch.float64)
    assert refusal("cuda", torch.bfloat16) is None and refusal("cpu", torch.float64) is None
