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


# --- sums folded into the op that computes a term (fold_into_producers) ---

def _fold_grads(fn, inputs):
    """(gradients with the backward graph's sums folded, eager autograd's, the adds in the traced
    backward graph, the folded graph)."""
    from torch_xaccel import families

    seen = []

    def backward_compiler(g, _inputs):
        seen.append(_adds(g))
        g = gradient_sums.fold_into_producers(g, families.addend_args())
        seen.append(g)
        return make_boxed_func(g.forward)

    compiled = aot_function(fn, fw_compiler=lambda g, _i: make_boxed_func(g.forward), bw_compiler=backward_compiler)
    cotangent = torch.randn_like(fn(*inputs))
    a = [t.clone().requires_grad_() for t in inputs]
    b = [t.clone().requires_grad_() for t in inputs]
    got = torch.autograd.grad((compiled(*a) * cotangent).sum(), a)
    want = torch.autograd.grad((fn(*b) * cotangent).sum(), b)
    return got, want, *seen


def _adds(g):
    return sum(n.target is aten.add.Tensor for n in g.graph.nodes)


def _addends(g, op, name):
    """The addend arguments of op's nodes (None where none)."""
    index = [a.name for a in op._schema.arguments].index(name)
    return [n.args[index] if index < len(n.args) else n.kwargs.get(name)
            for n in g.graph.nodes if n.target is op]


def _f64(*shape):
    return torch.randn(shape, dtype=torch.float64)


def _projections_of_one_input(x, w1, w2):  # x read by two per-head maps and a pointwise term
    return torch.ops.xaccel.headwise(x, w1) * torch.ops.xaccel.headwise(x, w2) + x.sin()


def test_headwise_input_gradients_take_the_sums():
    """x's gradient sums three terms: two headwise input gradients and sin's; both adds fold into
    the headwise ops (the second takes the first's result), and the gradients equal autograd's."""
    got, want, traced_adds, g = _fold_grads(_projections_of_one_input, [_f64(3, 7, 5, 4), _f64(5, 4, 4), _f64(5, 4, 4)])
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert traced_adds == 2 and _adds(g) == 0, g.graph
    assert sum(a is not None for a in _addends(g, torch.ops.xaccel.headwise.default, "addend")) == 2


def _gates_of_three_inputs(q, k, v, w, b):  # the mLSTM's gate projection beside other reads of q, k, v
    gates = torch.ops.xaccel.skinny_linear(w, b, [q, k, v])
    return torch.cat([gates, q * k, v.exp()], -1)


def test_skinny_linear_input_gradients_take_the_sums():
    got, want, traced_adds, g = _fold_grads(_gates_of_three_inputs,
                                            [_f64(2, 9, 6), _f64(2, 9, 6), _f64(2, 9, 5), _f64(3, 17), _f64(3)])
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    addends = _addends(g, torch.ops.xaccel.skinny_linear_backward.default, "addends")
    assert traced_adds == 3 and _adds(g) == 0, g.graph
    assert len(addends) == 1 and all(a is not None for a in addends[0])


def _broadcast_addend(x, w, other):
    return torch.ops.xaccel.headwise(x, w) + other[0]


def _read_elsewhere(x, w, other):
    y = torch.ops.xaccel.headwise(x, w)
    return y + other, y * 2


def _computed_from_the_output(x, w, other):
    y = torch.ops.xaccel.headwise(x, w)
    return y + y.exp()


def _other_dtype(x, w, other):
    return torch.ops.xaccel.headwise(x, w) + other.to(torch.float32)


@pytest.mark.parametrize("fn", [_broadcast_addend, _read_elsewhere, _computed_from_the_output, _other_dtype],
                         ids=["broadcast", "read-elsewhere", "depends-on-it", "dtype"])
def test_sums_that_cannot_fold_stay(fn):
    """A sum folds only where the op's output is read by the sum alone, the other term has the
    sum's shape and dtype, and it does not depend on the op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_xaccel import families

    args = (_f64(2, 3, 5, 4), _f64(5, 4, 4), _f64(2, 3, 5, 4))
    g = make_fx(fn)(*args)
    traced = _adds(g)
    want = fn(*args)
    g = gradient_sums.fold_into_producers(g, families.addend_args())
    assert traced == 1 and _adds(g) == 1, g.graph
    for a, b in zip(torch.utils._pytree.tree_leaves(g(*args)), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(a, b)


def test_a_sum_of_another_shape_folds_through_a_reshape():
    """The other term as the sum's shape, the op's output in its own: the addend is reshaped."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_xaccel import families

    def flat(x, w, other):
        return torch.ops.xaccel.headwise(x, w).flatten(-2) + other

    args = (_f64(2, 3, 5, 4), _f64(5, 4, 4), _f64(2, 3, 20))
    g = gradient_sums.fold_into_producers(make_fx(flat)(*args), families.addend_args())
    assert _adds(g) == 0, g.graph
    assert torch.allclose(g(*args), flat(*args), rtol=1e-12, atol=1e-12)


def _other_computed_later(x, w, z):  # the op moves after the other term
    y = torch.ops.xaccel.headwise(x, w)
    return y + z.exp()


def _other_viewed_later(x, w, z):  # the other term's view moves before the op
    e = z.exp()
    y = torch.ops.xaccel.headwise(x, w)
    return y + e.view(y.shape)


@pytest.mark.parametrize("fn", [_other_computed_later, _other_viewed_later], ids=["op-moves", "view-moves"])
def test_a_term_computed_after_the_op_still_folds(fn):
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_xaccel import families

    args = (_f64(2, 3, 5, 4), _f64(5, 4, 4), _f64(2, 3, 5, 4) if fn is _other_computed_later else _f64(2, 3, 20))
    g = gradient_sums.fold_into_producers(make_fx(fn)(*args), families.addend_args())
    assert _adds(g) == 0, g.graph
    assert torch.allclose(g(*args), fn(*args), rtol=1e-12, atol=1e-12)


def test_the_xlstm_package_mlstm_blocks_train_with_folded_sums(monkeypatch):
    """backend="xaccel" on the xlstm package's mLSTM block stack: each block's q, k and v gradient
    sums fold into its gate projection's backward and the convolution output's and up-projection's
    into the headwise input gradients; the train step equals eager's gradients."""
    pytest.importorskip("xlstm")
    from xlstm import mLSTMBlockConfig, mLSTMLayerConfig, xLSTMBlockStack, xLSTMBlockStackConfig

    from tests.helpers import rel_err

    folded, fold = [], gradient_sums.fold_into_producers

    def recording(g, addend_args):
        g = fold(g, addend_args)
        for op, name in ((torch.ops.xaccel.headwise.default, "addend"),
                         (torch.ops.xaccel.skinny_linear_backward.default, "addends")):
            for value in _addends(g, op, name):
                folded.extend(v is not None for v in (value if isinstance(value, list) else [value]))
        return g

    monkeypatch.setattr(gradient_sums, "fold_into_producers", recording)
    cfg = xLSTMBlockStackConfig(
        mlstm_block=mLSTMBlockConfig(mlstm=mLSTMLayerConfig(conv1d_kernel_size=4, qkv_proj_blocksize=4, num_heads=2)),
        context_length=32, num_blocks=2, embedding_dim=32)
    torch.manual_seed(0)
    model = xLSTMBlockStack(cfg)
    x = torch.randn(2, 32, 32)
    cotangent = torch.randn(2, 32, 32)
    params = list(model.parameters())
    torch._dynamo.reset()
    xc = x.clone().requires_grad_()
    got = torch.autograd.grad((torch.compile(model, backend="xaccel")(xc) * cotangent).sum(), params + [xc])
    xe = x.clone().requires_grad_()
    want = torch.autograd.grad((model(xe) * cotangent).sum(), params + [xe])
    assert sum(folded) == 2 * 6, folded  # per block: q, k, v (skinny_linear) and 3 headwise input gradients
    assert max(rel_err(a, b) for a, b in zip(got, want)) <= 1e-5
