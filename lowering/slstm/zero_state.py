"""An initial state that is all zeros, built in the graph, becomes "no initial state".

Library code passes a zero state explicitly (the xlstm package's cell creates `torch.zeros(4, B,
H)` when none is given). The op's semantics are the same either way, but without a state its
kernels skip loading it, and the batch fresh rule needs no look at n0 (with a state it asks the
host whether n0 has a positive entry: one synchronisation per call)."""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..graph_utils import mutated_nodes

aten = torch.ops.aten
_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
_FULL = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}
# ops through which a zero tensor stays zero: views, copies and dtype casts
_KEEPS_ZERO = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unbind.int,
               aten.select.int, aten.slice.Tensor, aten.expand.default, aten.clone.default,
               aten.contiguous.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
               aten.permute.default, aten.transpose.int, aten.squeeze.dim, aten.unsqueeze.default,
               aten.alias.default, aten.split.Tensor, aten.chunk.default, operator.getitem}
OPS = ("slstm", "slstm_saving")


def _is_zero(node, written: set) -> bool:
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node not in written:
        if node.target in _ZEROS:
            return True
        if node.target in _FULL:
            fill = node.args[_FULL[node.target]] if len(node.args) > _FULL[node.target] else None
            return isinstance(fill, (int, float)) and fill == 0
        if node.target not in _KEEPS_ZERO:
            return False
        node = node.args[0]
    return False


def run(gm: torch.fx.GraphModule) -> int:
    """Drop the zero initial states of the graph's sLSTM ops; returns how many ops changed."""
    targets = {getattr(torch.ops.xaccel, op).default for op in OPS}
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]
    if not nodes:
        return 0
    written = mutated_nodes(gm.graph)
    changed = 0
    for node in nodes:
        states = node.args[3:7]
        if len(states) == 4 and all(_is_zero(s, written) for s in states):
            node.args = (*node.args[:3], None, None, None, None, *node.args[7:])
            changed += 1
    if changed:
        gm.graph.eliminate_dead_code()
    return changed
