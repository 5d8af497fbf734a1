"""Training graphs: an sLSTM keeps each step's pre-activations and states for its backward."""
from __future__ import annotations

import dataclasses

import torch
import torch.fx

from .. import PassContext
from ..graph_utils import retarget

NOTE = "keeps its per-step states for the backward"


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """In a training graph, every xaccel.slstm whose backward runs as a kernel
    (codegen.slstm.backward_reads_kept_states) becomes xaccel.slstm_saving: the same first five
    outputs plus what the backward kernel reads, so the backward does not run the forward again
    (at the cost of holding 7 floats per unit and step until the backward). Its users index
    outputs 0-4, so only the target and the fake value change. The report notes each."""
    if ctx.training and keep(gm):
        ctx.report.replacements[:] = [
            dataclasses.replace(r, note="; ".join(filter(None, (r.note, NOTE)))) if r.op == "xaccel.slstm" else r
            for r in ctx.report.replacements]


def keep(gm: torch.fx.GraphModule) -> int:
    """Turn the graph's xaccel.slstm nodes into xaccel.slstm_saving where the backward kernel
    would read what it keeps; returns how many."""
    from torch_xaccel.codegen import slstm as kernels

    old, new = torch.ops.xaccel.slstm.default, torch.ops.xaccel.slstm_saving.default
    changed = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=old)):
        Wx, R = (a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args[:2])
        if not isinstance(Wx, torch.Tensor) or not isinstance(R, torch.Tensor) or node.kwargs:
            continue
        if isinstance(Wx.shape[-1], int) and kernels.backward_reads_kept_states(Wx, R):
            changed += retarget(node, new)
    return changed
