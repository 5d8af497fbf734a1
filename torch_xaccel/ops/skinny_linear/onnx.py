"""ONNX body of xaccel::skinny_linear: the reference exported by torch.onnx (the concatenation
and one MatMul with the bias), for the node's input count, ranks and dtypes."""
from __future__ import annotations

import torch

from . import reference


class _Reference(torch.nn.Module):
    def __init__(self, has_bias: bool):
        super().__init__()
        self.has_bias = has_bias

    def forward(self, tensors: list):  # weight, bias if present, then the inputs
        weight, rest = tensors[0], tensors[1:]
        bias, xs = (rest[0], rest[1:]) if self.has_bias else (None, rest)
        return reference.forward(weight, bias, list(xs))


def skinny_linear_function(call):
    """xaccel::skinny_linear(weight, bias?, xs...) -> y."""
    from torch_xaccel.onnx.functions import examples, function_of, reference_graph

    n_xs = int(call.attrs["xs_count"])
    has_bias = len(call.inputs) > 1 and call.inputs[1]
    positions = [0, *([1] if has_bias else []), *range(2, 2 + n_xs)]
    tensors, shapes = examples(call, positions)
    graph = reference_graph(_Reference(has_bias).eval(), (list(tensors),), ([*shapes],), call.opset)
    xs = [f"x{j}" for j in range(n_xs)]
    names = ["weight", *(["bias"] if has_bias else []), *xs]
    # declared in the node's input order, an absent bias included (an empty name binds nothing)
    return function_of(graph, names, ["y"], "skinny_linear_", order=["weight", "bias", *xs])
