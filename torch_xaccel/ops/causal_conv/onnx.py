"""ONNX body of xaccel::causal_conv1d: the reference exported by torch.onnx (a left Pad and a
grouped Conv at the compute dtype between two casts)."""
from __future__ import annotations

import torch

from . import reference


class _CausalConv(torch.nn.Module):
    def forward(self, x, w, bias=None):
        return reference.forward(x, w, bias)


def causal_conv1d_function(call):
    """xaccel::causal_conv1d(x, w, bias) -> y; an absent bias is no input of the body."""
    from torch_xaccel.onnx.functions import examples, function_of, reference_graph

    inputs = [i for i, present in enumerate(call.inputs[:3]) if present]
    tensors, shapes = examples(call, inputs)
    graph = reference_graph(_CausalConv().eval(), tensors, shapes, call.opset)
    return function_of(graph, ["x", "w", "bias"][:len(inputs)], ["y"], "causal_conv1d_")
