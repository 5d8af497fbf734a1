"""ONNX body of xaccel::headwise: the reference exported by torch.onnx (an Einsum at the compute
dtype between two casts)."""
from __future__ import annotations

import torch

from . import reference


class _Headwise(torch.nn.Module):
    def forward(self, x, w):
        return reference.forward(x, w)


def headwise_function(call):
    """xaccel::headwise(x, w) -> y."""
    from torch_xaccel.onnx.functions import examples, function_of, reference_graph

    tensors, shapes = examples(call, range(2))
    graph = reference_graph(_Headwise().eval(), tensors, shapes, call.opset)
    return function_of(graph, ["x", "w"], ["y"], "headwise_")
