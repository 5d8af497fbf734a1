"""The causal_conv reference against torch's own conv1d in float64 (both causal forms), its
backward against autograd, and the op's autograd against the reference's."""
import torch
import torch.nn.functional as F

from tests.helpers import rel_err
from torch_xaccel.ops.causal_conv import reference


def _conv(x, w, b):
    K = w.shape[-1]
    return F.conv1d(x, w.unsqueeze(1), b, padding=K - 1, groups=w.shape[0])[..., :x.shape[-1]]


def test_forward_is_the_causal_depthwise_conv1d_with_channels_innermost():
    torch.manual_seed(0)
    x = torch.randn(3, 11, 6, dtype=torch.float64).transpose(1, 2)  # [B, C, S], positions innermost
    w, b = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    y = reference.forward(x, w, b)
    assert rel_err(y, _conv(x, w, b)) <= 1e-12 and y.stride() == (66, 1, 6)
    assert rel_err(y, F.conv1d(F.pad(x, (3, 0)), w.unsqueeze(1), b, groups=6)) <= 1e-12
    half = reference.forward(x.half(), w.half(), None)
    assert half.dtype == torch.float16 and rel_err(half, _conv(x.half().double(), w.half().double(), None)) <= 1e-3


def test_backward_matches_autograd():
    torch.manual_seed(1)
    x = torch.randn(2, 5, 13, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 5, 13, dtype=torch.float64)
    _conv(x, w, b).backward(dy)
    dx, dw, db = reference.backward(dy, x.detach(), w.detach(), True)
    assert rel_err(dx, x.grad) <= 1e-12 and rel_err(dw, w.grad) <= 1e-12 and rel_err(db, b.grad) <= 1e-12
    assert reference.backward(dy, x.detach(), w.detach(), False)[2] is None


def test_op_gradients_match_the_reference_with_and_without_bias():
    torch.manual_seed(2)
    for with_bias in (True, False):
        x = torch.randn(3, 8, 10, requires_grad=True)
        w = torch.randn(8, 4, requires_grad=True)
        b = torch.randn(8, requires_grad=True) if with_bias else None
        y = torch.ops.xaccel.causal_conv1d(x, w, b)
        dy = torch.randn_like(y)
        y.backward(dy)
        xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
        bd = b.detach().double().requires_grad_() if with_bias else None
        _conv(xd, wd, bd).backward(dy.double())
        assert rel_err(y, _conv(xd, wd, bd)) <= 1e-6
        assert rel_err(x.grad, xd.grad) <= 1e-6 and rel_err(w.grad, wd.grad) <= 1e-6
        assert not with_bias or rel_err(b.grad, bd.grad) <= 1e-6
