"""eager_calls: each fast callable reaches the same ATen calls as its OpOverload and returns the
same result; the rewrite leaves nodes with other keyword arguments alone; a compiled decode step of
the xLSTMLarge package model calls no rewritable OpOverload and still equals eager."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_xaccel import eager_calls
from torch_xaccel.eager_calls import FAST_CALLS

aten = torch.ops.aten


def _samples():
    """OpOverload -> (args, kwargs): fresh random inputs of one op call each, as graphs pass them."""
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    sq, pos = torch.randn(4, 4), torch.rand(3, 4) + 0.5
    return {
        aten.add.Tensor: ((x, y), {"alpha": 2}),
        aten.sub.Tensor: ((x, 1.5), {}),
        aten.mul.Tensor: ((x, y), {}),
        aten.div.Tensor: ((x, pos), {}),
        aten.neg.default: ((x,), {}),
        aten.pow.Tensor_Scalar: ((x, 2), {}),
        aten.exp.default: ((x,), {}),
        aten.log.default: ((pos,), {}),
        aten.log1p.default: ((pos,), {}),
        aten.sqrt.default: ((pos,), {}),
        aten.rsqrt.default: ((pos,), {}),
        aten.abs.default: ((x,), {}),
        aten.tanh.default: ((x,), {}),
        aten.sigmoid.default: ((x,), {}),
        aten.silu.default: ((x,), {}),
        aten.maximum.default: ((x, y), {}),
        aten.minimum.default: ((x, y), {}),
        aten.where.self: ((x > 0, x, y), {}),
        aten.mean.dim: ((x, [-1], True), {"dtype": torch.float64}),
        aten.sum.dim_IntList: ((x, [0]), {}),
        aten.var.dim: ((x, [-1], False, True), {}),
        aten.linear.default: ((x, sq, torch.randn(4)), {}),
        aten.matmul.default: ((x, sq), {}),
        aten.mm.default: ((x, sq), {}),
        aten.bmm.default: ((x[None], sq[None]), {}),
        aten.addmm.default: ((torch.randn(4), x, sq), {"beta": 0.5}),
        aten.embedding.default: ((sq, torch.tensor([[0, 3, 1]])), {}),
        aten.to.dtype: ((x, torch.float16), {"copy": True}),
        aten.copy_.default: ((x.clone(), y), {}),
        aten.clone.default: ((x,), {"memory_format": torch.contiguous_format}),
        aten.reshape.default: ((x, [2, -1]), {}),
        aten.view.default: ((x, [4, 3]), {}),
        aten.transpose.int: ((x, 0, 1), {}),
        aten.permute.default: ((x, [1, 0]), {}),
        aten.t.default: ((x,), {}),
        aten.squeeze.dim: ((x[:, None], 1), {}),
        aten.unsqueeze.default: ((x, -1), {}),
        aten.expand.default: ((x[:, :1], [3, 4]), {}),
        aten.select.int: ((x, 1, 2), {}),
        aten.cat.default: (([x, y], 1), {}),
        aten.contiguous.default: ((x.t(),), {}),
        aten.detach.default: ((x,), {}),
        aten.native_layer_norm.default: ((x, [4], torch.randn(4), torch.randn(4), 1e-5), {}),
        aten.layer_norm.default: ((x, [4], torch.randn(4), None, 1e-5), {}),
        aten.split.Tensor: ((x, 3, 1), {}),
        aten.einsum.default: (("ij,jk->ik", [x, sq]), {}),
        aten.gelu.default: ((x,), {"approximate": "tanh"}),
    }


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _run(fn, args, kwargs):
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # copy_ writes its first input
    with _Calls() as calls:
        out = fn(*args, **kwargs)
    return out, calls.ops


def test_every_fast_call_reaches_the_same_aten_calls_and_result():
    samples = _samples()
    assert set(samples) == set(FAST_CALLS), "each table entry needs a sample here"
    for op, (args, kwargs) in samples.items():
        fast, allowed = FAST_CALLS[op]
        assert set(kwargs) <= allowed, op
        want, want_ops = _run(op, args, kwargs)
        got, got_ops = _run(fast, args, kwargs)
        assert got_ops == want_ops, f"{op}: {got_ops} != {want_ops}"
        assert type(got) is type(want) or {type(got), type(want)} <= {list, tuple}, op  # split: tuple vs list
        gots, wants = ((got,), (want,)) if isinstance(want, torch.Tensor) else (got, want)
        for g, w in zip(gots, wants, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), op


def _graph(div, kwargs):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(aten.mul.Tensor, (x, x))
    z = g.call_function(div, (y, 3.0), kwargs)
    g.output(g.call_function(aten.add.Tensor, (z, x), {"alpha": 2}))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_rewrite_keeps_nodes_with_other_keywords_and_the_result(monkeypatch):
    x = torch.randn(5, 3)
    plain = _graph(aten.div.Tensor, {})
    want = plain(x)
    eager_calls.rewrite(plain)
    assert [n.target for n in plain.graph.nodes if n.op == "call_function"] == [torch.mul, torch.div, torch.add]
    assert torch.equal(plain(x), want)
    rounding = _graph(aten.div.Tensor_mode, {"rounding_mode": "floor"})  # not in the table
    want = rounding(x)
    eager_calls.rewrite(rounding)
    targets = [n.target for n in rounding.graph.nodes if n.op == "call_function"]
    assert targets == [torch.mul, aten.div.Tensor_mode, torch.add]
    assert torch.equal(rounding(x), want)
    monkeypatch.setitem(FAST_CALLS, aten.div.Tensor_mode, (torch.div, set()))  # listed, without the keyword
    keyed = _graph(aten.div.Tensor_mode, {"rounding_mode": "floor"})
    eager_calls.rewrite(keyed)
    assert [n.target for n in keyed.graph.nodes if n.op == "call_function"][1] is aten.div.Tensor_mode


def test_decode_graph_runs_fast_calls_and_equals_eager(monkeypatch):
    """The package model's one-token step, compiled with the eager rest: its lowered graph keeps no
    OpOverload that the table covers, and the logits and states equal eager's (fp32, 1e-5)."""
    pytest.importorskip("xlstm")
    from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

    from torch_xaccel import backend

    graphs = []
    real = backend.eager_calls.rewrite
    monkeypatch.setattr(backend.eager_calls, "rewrite", lambda g: graphs.append(real(g)) or graphs[-1])
    monkeypatch.setenv("XACCEL_FALLBACK", "eager")
    cfg = xLSTMLargeConfig(vocab_size=96, chunk_size=16, mode="inference", return_last_states=True,
                           embedding_dim=64, num_heads=2, num_blocks=2, chunkwise_kernel="chunkwise--native_autograd",
                           sequence_kernel="native_sequence__native", step_kernel="native")
    torch.manual_seed(0)
    model = xLSTMLarge(cfg).eval()
    compiled = torch.compile(model, backend="xaccel", dynamic=False)
    prompt, tok = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 1))
    with torch.inference_mode():
        _, state = model(prompt)
        want, want_state = model(tok, state)
        _, state = model(prompt)
        got, got_state = compiled(tok, state)
    assert graphs, "the compiled step ran no eager rest"
    left = {str(n.target) for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and n.target in FAST_CALLS}
    assert not left, left
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    flat = lambda s: [t for blk in s.values() for t in blk]  # noqa: E731
    for g_, w_ in zip(flat(got_state), flat(want_state)):
        torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-5)
