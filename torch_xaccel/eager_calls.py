"""How a lowered graph that runs eagerly calls its ops: xaccel ops straight to their bodies, and
common ATen ops through the torch function that binds to the same overload (`torch.mul` for
`aten.mul.Tensor`).

Why: FX emits `torch.ops.aten.mul.Tensor(...)`, an OpOverload call: an attribute chain, a Python
frame and the dispatcher's boxed path, host time per call that `torch.mul`'s parsed binding does
not pay. A decoded token runs hundreds of ATen calls, and plain decode is host-bound, so that
overhead adds up to the token's latency. Only the overloads in FAST_CALLS are rewritten, and
only when a node passes no keyword arguments other than the ones listed: tests/test_eager_calls.py
checks for each entry that the torch function reaches the same ATen overload and gives the same
result. Every other node keeps its OpOverload.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _same_name(overload: str, *names: str) -> dict:
    """aten.<name>.<overload> -> torch.<name>, no keyword arguments."""
    return {getattr(getattr(aten, name), overload): (getattr(torch, name), set()) for name in names}


# OpOverload -> (the torch function that binds to it with the same positional arguments,
#                the keyword arguments it accepts under the same names)
FAST_CALLS = {
    **_same_name("default", "neg", "exp", "log", "log1p", "sqrt", "rsqrt", "abs", "tanh", "sigmoid", "maximum",
                 "minimum", "matmul", "mm", "bmm", "embedding", "reshape", "permute", "t", "unsqueeze", "cat",
                 "detach", "native_layer_norm", "layer_norm"),
    **_same_name("Tensor", "mul", "div"),
    **_same_name("int", "transpose", "select"),
    aten.squeeze.dim: (torch.squeeze, set()),
    aten.split.Tensor: (torch._C._VariableFunctions.split, set()),  # torch.split is a Python wrapper
    aten.einsum.default: (torch._C._VariableFunctions.einsum, set()),  # so is torch.einsum
    aten.pow.Tensor_Scalar: (torch.pow, set()),
    aten.where.self: (torch.where, set()),
    aten.var.dim: (torch.var, set()),
    aten.add.Tensor: (torch.add, {"alpha"}),
    aten.sub.Tensor: (torch.sub, {"alpha"}),
    aten.mean.dim: (torch.mean, {"dtype"}),
    aten.sum.dim_IntList: (torch.sum, {"dtype"}),
    aten.addmm.default: (torch.addmm, {"beta", "alpha"}),
    aten.clone.default: (torch.clone, {"memory_format"}),
    aten.silu.default: (torch._C._nn.silu, set()),
    aten.gelu.default: (torch._C._nn.gelu, {"approximate"}),
    aten.linear.default: (torch._C._nn.linear, set()),
    aten.to.dtype: (torch.Tensor.to, {"non_blocking", "copy", "memory_format"}),
    aten.copy_.default: (torch.Tensor.copy_, {"non_blocking"}),
    aten.view.default: (torch.Tensor.view, set()),
    aten.expand.default: (torch.Tensor.expand, set()),
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
        fast = FAST_CALLS.get(node.target)
        if fast is not None and set(node.kwargs) <= fast[1]:
            node.target = fast[0]
    g.recompile()
    return g
