"""ONNX body of xaccel::group_norm: the reference exported by torch.onnx (the normalization at the
compute dtype between two casts)."""
from __future__ import annotations

import torch

from . import reference


class _GroupNorm(torch.nn.Module):
    def __init__(self, groups: int, eps: float, has_weight: bool, has_bias: bool):
        super().__init__()
        self.groups, self.eps, self.has_weight, self.has_bias = groups, eps, has_weight, has_bias

    def forward(self, x, first=None, second=None):  # the parameters present, in order
        weight = first if self.has_weight else None
        bias = (second if self.has_weight else first) if self.has_bias else None
        return reference.forward(x, weight, bias, self.groups, self.eps)


def group_norm_function(call):
    """xaccel::group_norm(x, weight?, bias?) -> y, groups and eps as attributes."""
    from torch_xaccel.onnx.functions import examples, function_of, reference_graph

    present = list(call.inputs[:3]) + [False] * (3 - len(call.inputs[:3]))
    inputs = [i for i in range(3) if present[i]]
    tensors, shapes = examples(call, inputs)
    module = _GroupNorm(int(call.attrs["groups"]), float(call.attrs["eps"]), present[1], present[2]).eval()
    graph = reference_graph(module, tensors, shapes, call.opset)
    return function_of(graph, [["x", "weight", "bias"][i] for i in inputs], ["y"], "group_norm_")
