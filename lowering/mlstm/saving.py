"""Training graphs: an mLSTM keeps the state entering each chunk for its backward."""
from __future__ import annotations

import dataclasses

import torch
import torch.fx

from .. import PassContext
from ..graph_utils import retarget

NOTE = "keeps its chunk states for the backward"


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """In a training graph (unless XACCEL_MLSTM_SAVING=0), every xaccel.mlstm whose kernels'
    backward would read them (codegen.mlstm.backward_reads_kept_states: the kernels run there and
    every backward config walks that chunk) becomes xaccel.mlstm_saving: the same first four
    outputs, plus the states entering each chunk, which its backward reads instead of rerunning the
    sequential scan. Its users index outputs 0-3, so only the target and the fake value change; a
    node without a fake value is left alone. The report notes each."""
    if ctx.training and ctx.config.mlstm_saving and keep(gm):
        ctx.report.replacements[:] = [
            dataclasses.replace(r, note="; ".join(filter(None, (r.note, NOTE)))) if r.op == "xaccel.mlstm" else r
            for r in ctx.report.replacements]


def keep(gm: torch.fx.GraphModule) -> int:
    """Turn the graph's xaccel.mlstm nodes into xaccel.mlstm_saving where that pays; returns how
    many."""
    from torch_xaccel.codegen import mlstm as kernels

    old, new = torch.ops.xaccel.mlstm.default, torch.ops.xaccel.mlstm_saving.default
    changed = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=old)):
        args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
        q, v = args[0], args[2]
        chunk = args[9] if len(args) > 9 else node.kwargs.get("chunk_size")
        if not isinstance(q, torch.Tensor) or not isinstance(v, torch.Tensor):
            continue
        DK, DV = q.shape[-1], v.shape[-1]
        if not all(isinstance(d, int) for d in (DK, DV, chunk)) or \
                not kernels.backward_reads_kept_states(q.device.type, q.dtype, DK, DV, chunk):
            continue
        changed += retarget(node, new)
    return changed
