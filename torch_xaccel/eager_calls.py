"""How a lowered graph that runs eagerly calls its ops: xaccel ops straight to their bodies, and
common ATen ops through the torch function that binds to the same overload (`torch.mul` for
`aten.mul.Tensor`).

Why: FX emits `torch.ops.aten.mul.Tensor(...)`, an OpOverload call: an attribute chain, a Python
frame and the dispatcher's boxed path, 0.4-1.4 us more per call than `torch.mul`'s parsed binding
on this project's CPU machine. A decoded token of the 7B-width xLSTMLarge runs ~250 ATen calls,
and plain decode is host-bound, so that overhead is the token's latency. Only the overloads in
FAST_CALLS are rewritten, and only when a node passes no keyword arguments other than the ones
listed: tests/test_eager_calls.py checks for each entry that the torch function reaches the same
ATen overload and gives the same result. Every other node keeps its OpOverload.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
ENABLED = True  # False: only the xaccel ops go direct (the A/B of the host time FAST_CALLS saves)

# OpOverload -> (the torch function that binds to it with the same positional arguments,
#                the keyword arguments it accepts under the same names)
FAST_CALLS = {
    aten.add.Tensor: (torch.add, {"alpha"}),
    aten.sub.Tensor: (torch.sub, {"alpha"}),
    aten.mul.Tensor: (torch.mul, set()),
    aten.div.Tensor: (torch.div, set()),
    aten.neg.default: (torch.neg, set()),
    aten.pow.Tensor_Scalar: (torch.pow, set()),
    aten.exp.default: (torch.exp, set()),
    aten.log.default: (torch.log, set()),
    aten.log1p.default: (torch.log1p, set()),
    aten.sqrt.default: (torch.sqrt, set()),
    aten.rsqrt.default: (torch.rsqrt, set()),
    aten.abs.default: (torch.abs, set()),
    aten.tanh.default: (torch.tanh, set()),
    aten.sigmoid.default: (torch.sigmoid, set()),
    aten.silu.default: (torch._C._nn.silu, set()),
    aten.maximum.default: (torch.maximum, set()),
    aten.minimum.default: (torch.minimum, set()),
    aten.where.self: (torch.where, set()),
    aten.mean.dim: (torch.mean, {"dtype"}),
    aten.sum.dim_IntList: (torch.sum, {"dtype"}),
    aten.var.dim: (torch.var, set()),
    aten.linear.default: (torch._C._nn.linear, set()),
    aten.matmul.default: (torch.matmul, set()),
    aten.mm.default: (torch.mm, set()),
    aten.bmm.default: (torch.bmm, set()),
    aten.addmm.default: (torch.addmm, {"beta", "alpha"}),
    aten.embedding.default: (torch.embedding, set()),
    aten.to.dtype: (torch.Tensor.to, {"non_blocking", "copy", "memory_format"}),
    aten.copy_.default: (torch.Tensor.copy_, {"non_blocking"}),
    aten.clone.default: (torch.clone, {"memory_format"}),
    aten.reshape.default: (torch.reshape, set()),
    aten.view.default: (torch.Tensor.view, set()),
    aten.transpose.int: (torch.transpose, set()),
    aten.permute.default: (torch.permute, set()),
    aten.t.default: (torch.t, set()),
    aten.squeeze.dim: (torch.squeeze, set()),
    aten.unsqueeze.default: (torch.unsqueeze, set()),
    aten.expand.default: (torch.Tensor.expand, set()),
    aten.select.int: (torch.select, set()),
    aten.cat.default: (torch.cat, set()),
    aten.contiguous.default: (torch.Tensor.contiguous, {"memory_format"}),
}


def rewrite(g: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Point the graph's nodes at their fast callables (in place) and regenerate its code. Only
    for graphs that run eagerly: Inductor and aot_autograd's tracing want OpOverloads."""
    from .ops import DIRECT_CALLS

    for node in g.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in DIRECT_CALLS:
            node.target = DIRECT_CALLS[node.target]
            continue
        fast = FAST_CALLS.get(node.target) if ENABLED else None
        if fast is not None and set(node.kwargs) <= fast[1]:
            node.target = fast[0]
    g.recompile()
    return g
