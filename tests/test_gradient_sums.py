"""gradient_sums: a backward sum of zero-padded slice gradients that tile a dimension runs as one
cat, equal to autograd's sum; overlapping, gapped or strided slices stay as traced. (chunk and
split need no rewrite: their backward is a cat already.)"""
import pytest
import torch
from functorch.compile import aot_function, make_boxed_func

from torch_xaccel import gradient_sums

aten = torch.ops.aten


def _grads_through_rewrite(fn, x):
    """(x's gradient with the backward graph rewritten, the same from eager autograd, the
    rewritten backward graph's call targets)."""
    seen = []

    def backward_compiler(g, _inputs):
        g = gradient_sums.rewrite(g)
        seen.extend(n.target for n in g.graph.nodes if n.op == "call_function")
        return make_boxed_func(g.forward)

    compiled = aot_function(fn, fw_compiler=lambda g, _i: make_boxed_func(g.forward), bw_compiler=backward_compiler)
    cotangent = torch.randn_like(fn(x))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled(xa).backward(cotangent)
    fn(xb).backward(cotangent)
    return xa.grad, xb.grad, seen


def _halves(x):  # a projection's output read as two gates (the skinny_linear op's slices)
    return x[..., :8] * torch.nn.functional.silu(x[..., 8:])


def _three_parts(x):
    a, b, c = x[:, :3], x[:, 3:8], x[:, 8:]
    return a.sum(1, keepdim=True) * b.exp() + c.square().sum(1, keepdim=True)


def _negative_bounds(x):
    return x[..., :-4].sin().sum(-1) + x[..., -4:].cos().sum(-1)


@pytest.mark.parametrize("fn,shape", [(_halves, (2, 5, 16)), (_three_parts, (3, 12, 7)), (_negative_bounds, (4, 11))],
                         ids=["halves", "three", "negative"])
def test_tiling_slices_become_one_cat_and_equal_autograd(fn, shape):
    x = torch.randn(shape, dtype=torch.float64)
    got, want, targets = _grads_through_rewrite(fn, x)
    assert torch.equal(got, want)
    assert aten.slice_backward.default not in targets and aten.cat.default in targets, targets


def _overlapping(x):
    return x[..., :6].sin().sum(-1) + x[..., 4:].cos().sum(-1)


def _gapped(x):
    return x[..., :4].sin().sum(-1) + x[..., 6:].cos().sum(-1)


def _strided(x):
    return x[..., ::2].sin().sum(-1) + x[..., 1::2].cos().sum(-1)


@pytest.mark.parametrize("fn", [_overlapping, _gapped, _strided], ids=["overlap", "gap", "strided"])
def test_slices_that_do_not_tile_stay_as_traced(fn):
    x = torch.randn(3, 10, dtype=torch.float64)
    got, want, targets = _grads_through_rewrite(fn, x)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    assert aten.slice_backward.default in targets, targets


def test_the_backend_rewrites_a_compiled_train_steps_backward(monkeypatch):
    """backend="xaccel" with the eager rest runs the rewrite on the backward graph: a gated block
    (two slices of a projection's tanh; a gate of the projection itself would become a dual GEMM)
    trains to eager's gradients without slice_backward."""
    from tests.helpers import rel_err

    seen, rewrite = [], gradient_sums.rewrite

    def recording(g):
        g = rewrite(g)
        seen.extend(n.target for n in g.graph.nodes if n.op == "call_function")
        return g

    monkeypatch.setattr(gradient_sums, "rewrite", recording)
    torch.manual_seed(0)
    up, down = torch.nn.Linear(24, 64), torch.nn.Linear(32, 24)

    def block(x):
        y = torch.tanh(up(x))
        return down(y[..., :32] * torch.nn.functional.silu(y[..., 32:])) + x

    x = torch.randn(3, 5, 24)
    cotangent = torch.randn(3, 5, 24)
    torch._dynamo.reset()
    params = [up.weight, up.bias, down.weight]
    xc = x.clone().requires_grad_()
    got = torch.autograd.grad((torch.compile(block, backend="xaccel")(xc) * cotangent).sum(), params + [xc])
    xe = x.clone().requires_grad_()
    want = torch.autograd.grad((block(xe) * cotangent).sum(), params + [xe])
    assert seen and aten.slice_backward.default not in seen and aten.cat.default in seen, seen
    assert max(rel_err(a, b) for a, b in zip(got, want)) <= 1e-5
