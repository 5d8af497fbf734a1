"""The headwise reference against the definition written out per head in float64, and its weight
gradient against autograd."""
import torch

from tests.helpers import rel_err
from torch_xaccel.ops.headwise import reference


def _per_head(x, w):
    return torch.stack([x[..., h, :] @ w[h].T for h in range(w.shape[0])], -2)


def test_forward_is_one_linear_map_per_head():
    torch.manual_seed(0)
    x, w = torch.randn(3, 7, 5, 3, dtype=torch.float64), torch.randn(5, 4, 3, dtype=torch.float64)
    assert rel_err(reference.forward(x, w), _per_head(x, w)) <= 1e-12
    got = reference.forward(x.float().half(), w.half())
    assert got.dtype == torch.float16 and rel_err(got, _per_head(x.half().double(), w.half().double())) <= 1e-3


def test_weight_grad_and_input_grad_match_autograd():
    torch.manual_seed(1)
    x = torch.randn(2, 9, 6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 5, 4, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 9, 6, 5, dtype=torch.float64)
    _per_head(x, w).backward(dy)
    assert rel_err(reference.weight_grad(dy, x.detach()), w.grad) <= 1e-12
    assert rel_err(reference.forward(dy, w.detach().transpose(1, 2)), x.grad) <= 1e-12


def test_op_gradients_match_the_reference():
    torch.manual_seed(2)
    x = torch.randn(4, 3, 8, 4, requires_grad=True)
    w = torch.randn(8, 4, 4, requires_grad=True)
    y = torch.ops.xaccel.headwise(x, w)
    dy = torch.randn_like(y)
    y.backward(dy)
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    _per_head(xd, wd).backward(dy.double())
    assert rel_err(y, _per_head(xd, wd)) <= 1e-6
    assert rel_err(x.grad, xd.grad) <= 1e-6 and rel_err(w.grad, wd.grad) <= 1e-6
