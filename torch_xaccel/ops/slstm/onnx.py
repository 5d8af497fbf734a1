"""ONNX bodies of xaccel::slstm and xaccel::slstm_step, generated from reference.step.

The step is exported once per call form (variant, input dtype, opset) by torch.onnx itself, with
the batch, head and unit sizes symbolic, so the body is the reference's own math: slstm_step's
function is that graph, slstm's a Scan over time with the step as its body, carrying (h, c, n, m)
and emitting each step's h, so the file stays the same size for any sequence length. R and b reach
the Scan body from the function's scope."""
from __future__ import annotations

import functools

import onnx
import torch
from onnx import TensorProto, helper

from . import reference

_STATE_NAMES = ("h", "c", "n", "m")


class _Step(torch.nn.Module):
    def __init__(self, fresh: str, clamp_gates: bool, clamp_n: bool):
        super().__init__()
        self.variant = (fresh, clamp_gates, clamp_n)

    def forward(self, h, c, n, m, Wx_t, R, b):
        h2, c2, n2, m2 = reference.step(Wx_t, R, b, h, c, n, m, *self.variant)
        return h2, c2, n2, m2, h2.to(Wx_t.dtype)


@functools.lru_cache(maxsize=None)
def _step_graph(fresh: str, clamp_gates: bool, clamp_n: bool, elem_type: int, opset: int) -> onnx.GraphProto:
    """reference.step as an ONNX graph: inputs h, c, n, m (compute dtype), Wx_t, R, b; outputs
    h', c', n', m' and h' in Wx_t's dtype."""
    from torch_xaccel.onnx.functions import reference_graph, torch_dtype

    dtype = torch_dtype(elem_type)
    if dtype is None:
        raise ValueError(f"xaccel::slstm: no ONNX body for element type {TensorProto.DataType.Name(elem_type)}")
    cd = reference.compute_dtype(torch.empty(0, dtype=dtype))
    B, NH, D = 3, 2, 5  # any sizes: they are symbolic in the graph
    states = [torch.rand(B, NH, D, dtype=cd) + 0.5 for _ in range(4)]
    example = (*states, torch.randn(B, 4, NH, D, dtype=dtype), torch.randn(NH, 4, D, D, dtype=dtype),
               torch.randn(4, NH, D, dtype=dtype))
    batch, heads, units = torch.export.Dim("batch"), torch.export.Dim("heads"), torch.export.Dim("units")
    state = {0: batch, 1: heads, 2: units}
    shapes = (state, state, state, state, {0: batch, 2: heads, 3: units}, {0: heads, 2: units, 3: units},
              {1: heads, 2: units})
    return reference_graph(_Step(fresh, bool(clamp_gates), bool(clamp_n)).eval(), example, shapes, opset)


def _variant(call) -> tuple:
    fresh = call.attrs["fresh"]
    fresh = fresh.decode() if isinstance(fresh, bytes) else fresh
    return fresh, int(call.attrs["clamp_gates"]), int(call.attrs["clamp_n"])


def slstm_step_function(call) -> onnx.FunctionProto:
    """xaccel::slstm_step(Wx, R, b, h, c, n, m) -> (h', c', n', m'): the step graph itself."""
    from torch_xaccel.onnx.functions import function_of

    graph = _step_graph(*_variant(call), call.elem_types[0], call.opset)  # inputs h, c, n, m, Wx_t, R, b
    return function_of(graph, [*_STATE_NAMES, "Wx", "R", "b"], ["h_out", "c_out", "n_out", "m_out"], "step_",
                       order=["Wx", "R", "b", *_STATE_NAMES])


def slstm_function(call) -> onnx.FunctionProto:
    """xaccel::slstm(Wx, R, b, h0?, c0?, n0?, m0?) -> (y, hT, cT, nT, mT): a Scan over time."""
    from torch_xaccel.onnx.functions import renamed_graph

    present = call.inputs + (False,) * (7 - len(call.inputs))
    if any(present[3:]) and not all(present[3:]):
        raise ValueError("xaccel::slstm: give all four initial states or none")
    elem = call.elem_types[0]
    graph = _step_graph(*_variant(call), elem, call.opset)
    inner = [v.name for v in graph.input]
    body = renamed_graph(graph, "step_", {inner[5]: "R", inner[6]: "b"})  # R, b from the function's scope
    nodes = []
    if present[3]:
        starts, inputs = ["h0", "c0", "n0", "m0"], ["Wx", "R", "b", "h0", "c0", "n0", "m0"]
    else:
        inputs = ["Wx", "R", "b"]
        cd = TensorProto.DOUBLE if elem == TensorProto.DOUBLE else TensorProto.FLOAT
        nodes += [helper.make_node("Shape", ["Wx"], ["wx_shape"]),
                  helper.make_node("Constant", [], ["state_axes"],
                                   value=helper.make_tensor("axes", TensorProto.INT64, [3], [0, 3, 4])),
                  helper.make_node("Gather", ["wx_shape", "state_axes"], ["state_shape"]),
                  helper.make_node("ConstantOfShape", ["state_shape"], ["zeros"],
                                   value=helper.make_tensor("zero", cd, [1], [0]))]
        starts = ["zeros"] * 4
    nodes.append(helper.make_node("Scan", [*starts, "Wx"], ["hT", "cT", "nT", "mT", "y"], body=body,
                                  num_scan_inputs=1, scan_input_axes=[1], scan_output_axes=[1]))
    return helper.make_function("xaccel", "slstm", inputs, ["y", "hT", "cT", "nT", "mT"], nodes, [])
