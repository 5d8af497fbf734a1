"""ONNX bodies of xaccel::mlstm and xaccel::mlstm_step, generated from the reference.

mlstm: the reference's chunkwise form. `reference.prepared` (scaled k, logsigmoid(f), the tail
padded to whole chunks), exported for the node's shapes, cut into chunks; a Scan over the chunks
carrying (C, n, m) whose body is `reference.chunk_step` exported by torch.onnx (the parallel form
within a chunk); the chunks' h joined and trimmed to S. Memory stays linear in S. mlstm_step: the
reference step itself."""
from __future__ import annotations

import functools

import torch
from onnx import TensorProto, helper

from . import reference


class _Prepared(torch.nn.Module):
    def __init__(self, chunk_size: int):
        super().__init__()
        self.L = chunk_size

    def forward(self, q, k, v, i, f):
        q, k, v, i, logf = reference.prepared(q, k, v, i, f, self.L)
        return tuple(t.unflatten(2, (-1, self.L)) for t in (q, k, v, i, logf))  # [B, H, NC, L, ...]


class _Chunk(torch.nn.Module):
    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, C, n, m, qc, kc, vc, ic, logfc):
        h_c, C, n, m, _, _ = reference.chunk_step(qc, kc, vc, ic, logfc, C, n, m, self.eps)
        return C, n, m, h_c


class _Step(torch.nn.Module):
    def __init__(self, eps: float, scale_q: bool):
        super().__init__()
        self.eps, self.scale_q = eps, scale_q

    def forward(self, q, k, v, i, f, C, n, m):
        return reference.step(q, k, v, i, f, C, n, m, eps=self.eps, scale_q=self.scale_q)


@functools.lru_cache(maxsize=None)
def _chunk_graph(L: int, elem: int, eps: float, opset: int):
    """reference.chunk_step as the Scan's body, every size symbolic: one export per variant and
    process (the costliest of the bodies; callers copy it)."""
    from torch_xaccel.onnx.functions import reference_graph

    cd = torch.float64 if elem == TensorProto.DOUBLE else torch.float32
    B, H, DK, DV = 2, 3, 4, 5  # any sizes: symbolic in the graph
    example = (torch.randn(B, H, DK, DV, dtype=cd), torch.randn(B, H, DK, dtype=cd), torch.randn(B, H, dtype=cd),
               torch.randn(B, H, L, DK, dtype=cd), torch.randn(B, H, L, DK, dtype=cd),
               torch.randn(B, H, L, DV, dtype=cd), torch.randn(B, H, L, dtype=cd), -torch.rand(B, H, L, dtype=cd))
    b, h, dk, dv = (torch.export.Dim(n) for n in ("batch", "heads", "dk", "dv"))
    shapes = ({0: b, 1: h, 2: dk, 3: dv}, {0: b, 1: h, 2: dk}, {0: b, 1: h}, {0: b, 1: h, 3: dk}, {0: b, 1: h, 3: dk},
              {0: b, 1: h, 3: dv}, {0: b, 1: h}, {0: b, 1: h})
    return reference_graph(_Chunk(eps).eval(), example, shapes, opset)


def mlstm_function(call):
    """xaccel::mlstm(q, k, v, i, f, C0?, n0?, m0?) -> (h, C, n, m)."""
    from torch_xaccel.onnx.functions import examples, reference_graph, renamed_graph

    present = call.inputs + (False,) * (8 - len(call.inputs))
    if any(present[5:]) and not all(present[5:]):
        raise ValueError("xaccel::mlstm: give all three initial states or none")
    L, eps, elem = int(call.attrs["chunk_size"]), float(call.attrs["eps"]), call.elem_types[0]
    cd = TensorProto.DOUBLE if elem == TensorProto.DOUBLE else TensorProto.FLOAT
    tensors, shapes = examples(call, range(5))
    graph = reference_graph(_Prepared(L).eval(), tensors, shapes, call.opset)
    pre = renamed_graph(graph, "pre_", {v.name: x for v, x in zip(graph.input, "qkvif")})
    chunked = ["q_chunks", "k_chunks", "v_chunks", "i_chunks", "logf_chunks"]
    nodes = list(pre.node) + [helper.make_node("Identity", [o.name], [c]) for o, c in zip(pre.output, chunked)]

    def const(name, values):
        nodes.append(helper.make_node("Constant", [], [name],
                                      value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values)))

    nodes += [helper.make_node("Shape", ["q"], ["q_shape"]), helper.make_node("Shape", ["v"], ["v_shape"])]
    const("ax01", [0, 1]), const("ax2", [2]), const("ax3", [3]), const("minus1", [-1]), const("zero", [0])
    nodes += [helper.make_node("Gather", [shape, axes], [out])
              for shape, axes, out in (("q_shape", "ax01", "bh"), ("q_shape", "ax3", "dk"), ("v_shape", "ax3", "dv"),
                                       ("q_shape", "ax2", "S"))]
    inputs = ["q", "k", "v", "i", "f"]
    if present[5]:
        inputs += ["C0", "n0", "m0"]
        nodes += [helper.make_node("Cast", [s], [f"{s}_cd"], to=cd) for s in ("C0", "n0", "m0")]
        starts = ["C0_cd", "n0_cd", "m0_cd"]
    else:
        zero = helper.make_tensor("zero", cd, [1], [0])
        nodes += [helper.make_node("Concat", ["bh", "dk", "dv"], ["C_shape"], axis=0),
                  helper.make_node("Concat", ["bh", "dk"], ["n_shape"], axis=0),
                  helper.make_node("ConstantOfShape", ["C_shape"], ["C_zero"], value=zero),
                  helper.make_node("ConstantOfShape", ["n_shape"], ["n_zero"], value=zero),
                  helper.make_node("ConstantOfShape", ["bh"], ["m_start"],  # no state: m0 = -inf
                                   value=helper.make_tensor("ninf", cd, [1], [float("-inf")]))]
        starts = ["C_zero", "n_zero", "m_start"]
    body = renamed_graph(_chunk_graph(L, elem, eps, call.opset), "chunk_", {})
    nodes.append(helper.make_node("Scan", [*starts, *chunked], ["C", "n", "m", "h_chunks"], body=body,
                                  num_scan_inputs=5, scan_input_axes=[2] * 5, scan_output_axes=[2]))
    nodes += [helper.make_node("Concat", ["bh", "minus1", "dv"], ["h_shape"], axis=0),
              helper.make_node("Reshape", ["h_chunks", "h_shape"], ["h_padded"]),
              helper.make_node("Slice", ["h_padded", "zero", "S", "ax2"], ["h_cd"]),
              helper.make_node("Cast", ["h_cd"], ["h"], to=elem)]
    return helper.make_function("xaccel", "mlstm", inputs, ["h", "C", "n", "m"], nodes, [])


def mlstm_step_function(call):
    """xaccel::mlstm_step(q, k, v, i, f, C, n, m) -> (h, C', n', m')."""
    from torch_xaccel.onnx.functions import examples, function_of, reference_graph

    tensors, shapes = examples(call, range(8))
    module = _Step(float(call.attrs["eps"]), bool(call.attrs.get("scale_q", 0))).eval()
    graph = reference_graph(module, tensors, shapes, call.opset)
    return function_of(graph, ["q", "k", "v", "i", "f", "C", "n", "m"], ["h", "C_out", "n_out", "m_out"], "step_")
