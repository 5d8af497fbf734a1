"""The group_norm reference against torch's group_norm in float64, its backward against autograd,
and the op's autograd against the reference's, with and without weight and bias."""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err
from torch_xaccel.ops.group_norm import reference


@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_backward_matches_autograd(affine):
    torch.manual_seed(0)
    x = torch.randn(7, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, dtype=torch.float64, requires_grad=True) if affine != "none" else None
    b = torch.randn(24, dtype=torch.float64, requires_grad=True) if affine == "both" else None
    dy = torch.randn(7, 24, dtype=torch.float64)
    want = F.group_norm(x, 4, w, b, 1e-5)
    assert rel_err(reference.forward(x.detach(), w, b, 4, 1e-5), want) <= 1e-12
    want.backward(dy)
    dx, dw, db = reference.backward(dy, x.detach(), None if w is None else w.detach(), 4, 1e-5, b is not None)
    assert rel_err(dx, x.grad) <= 1e-10
    assert (dw is None) == (w is None) and (w is None or rel_err(dw, w.grad) <= 1e-10)
    assert (db is None) == (b is None) and (b is None or rel_err(db, b.grad) <= 1e-10)


def test_op_gradients_match_torch_and_half_rounds_once():
    torch.manual_seed(1)
    x = torch.randn(5, 3, 16)[:, 1]  # a strided view [5, 16]
    x.requires_grad_()
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    y = torch.ops.xaccel.group_norm(x, w, b, 2, 1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    F.group_norm(xd, 2, wd, bd, 1e-5).backward(dy.double())
    assert rel_err(y, F.group_norm(xd, 2, wd, bd, 1e-5)) <= 1e-6
    assert all(rel_err(g, r.grad) <= 1e-5 for g, r in ((x.grad, xd), (w.grad, wd), (b.grad, bd)))
    half = reference.forward(x.detach().half(), w.detach().half(), None, 2, 1e-5)
    assert half.dtype == torch.float16
    assert rel_err(half, F.group_norm(x.detach().half().double(), 2, w.detach().half().double(), None, 1e-5)) <= 1e-3
