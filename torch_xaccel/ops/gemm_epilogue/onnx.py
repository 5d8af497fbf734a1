"""ONNX body of xaccel::gemm_epilogue, generated from reference.forward: the GEMMs and the
epilogue program of the node's `epilogue` attribute, exported by torch.onnx for the node's input
ranks and dtypes with its symbolic dims kept symbolic (one body per call form)."""
from __future__ import annotations

import torch

from . import reference


class _Reference(torch.nn.Module):
    def __init__(self, n_bs: int, epilogue: str, b_transposed: bool):
        super().__init__()
        self.n_bs, self.epilogue, self.b_transposed = n_bs, epilogue, b_transposed

    def forward(self, tensors: list):  # one list argument: its items become the graph's inputs in order
        a, bs, operands = tensors[0], tensors[1:1 + self.n_bs], tensors[1 + self.n_bs:]
        return tuple(reference.forward(a, list(bs), list(operands), self.epilogue, self.b_transposed))


def gemm_epilogue_function(call):
    """xaccel::gemm_epilogue(a, b_0[, b_1], operands...) -> its outputs."""
    from torch_xaccel.onnx.functions import examples, function_of, reference_graph

    n_bs, n_ops = int(call.attrs["bs_count"]), int(call.attrs.get("operands_count", 0))
    epilogue = call.attrs["epilogue"]
    epilogue = epilogue.decode() if isinstance(epilogue, bytes) else epilogue
    positions = list(range(1 + n_bs + n_ops))
    tensors, shapes = examples(call, positions)
    module = _Reference(n_bs, epilogue, bool(call.attrs["b_transposed"])).eval()
    with torch.no_grad():
        n_out = len(module(list(tensors)))
    graph = reference_graph(module, (list(tensors),), ([*shapes],), call.opset)
    names = ["a", *(f"b{j}" for j in range(n_bs)), *(f"operand{j}" for j in range(n_ops))]
    return function_of(graph, names, [f"out{j}" for j in range(n_out)], "gemm_")
