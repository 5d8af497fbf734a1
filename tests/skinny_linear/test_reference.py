"""The skinny_linear reference against torch's linear of the concatenation in float64, its
backward against autograd, and the op's autograd against the reference's."""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err
from torch_xaccel.ops.skinny_linear import reference


@pytest.mark.parametrize("widths,bias", [((12, 7, 30), True), ((16,), False)])
def test_backward_matches_autograd(widths, bias):
    torch.manual_seed(0)
    xs = [torch.randn(3, 5, w, dtype=torch.float64, requires_grad=True) for w in widths]
    w = torch.randn(6, sum(widths), dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True) if bias else None
    want = F.linear(torch.cat(xs, -1), w, b)
    assert rel_err(reference.forward(w.detach(), b, [x.detach() for x in xs]), want) <= 1e-12
    dy = torch.randn_like(want)
    want.backward(dy)
    *dxs, dw, db = reference.backward(dy, w.detach(), [x.detach() for x in xs], bias)
    assert all(rel_err(d, x.grad) <= 1e-10 for d, x in zip(dxs, xs))
    assert rel_err(dw, w.grad) <= 1e-10
    assert (db.numel() == 0) if not bias else rel_err(db, b.grad) <= 1e-10


def test_op_gradients_match_torch_on_strided_inputs():
    torch.manual_seed(1)
    xs = [torch.randn(4, 2, 20)[..., :9].requires_grad_(), torch.randn(4, 2, 5, requires_grad=True)]
    w, b = torch.randn(3, 14, requires_grad=True), torch.randn(3, requires_grad=True)
    y = torch.ops.xaccel.skinny_linear(w, b, xs)
    dy = torch.randn_like(y)
    y.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (*xs, w, b)]
    want = F.linear(torch.cat(leaves[:2], -1), leaves[2], leaves[3])
    want.backward(dy.double())
    assert rel_err(y, want) <= 1e-6
    assert all(rel_err(t.grad, r.grad) <= 1e-5 for t, r in zip((*xs, w, b), leaves))
