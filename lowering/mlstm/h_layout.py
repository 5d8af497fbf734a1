"""An mLSTM writes h seq-major where every reader of h transposes it to [B, S, H, DV] first.

The xlstm package, transformers and most hand-written forms read the mLSTM's h [B, H, S, DV]
as h.transpose(1, 2) and then merge the heads (reshape to [B, S, H*DV], a head norm over it):
from a contiguous h that reshape copies the whole output. With seq_major_h the op writes h as a
contiguous [B, S, H, DV] (ops/mlstm/op.h_like), the transpose gives that contiguous tensor and
the reshape is a view. Where h has any other reader, its layout stays contiguous: a reader that
views h as laid out would fail on another layout, while after the transpose every view that was
valid on the strided tensor is valid on the contiguous one."""
from __future__ import annotations

import operator

import torch
import torch.fx

from .. import PassContext
from ..graph_utils import named_arguments, refake, refake_downstream

_N_ARGS = 10  # xaccel::mlstm's arguments before seq_major_h


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.xaccel.mlstm.default):
        if not _seq_major(node) and _h_readers_transpose(node):
            if len(node.args) > _N_ARGS:
                node.update_arg(_N_ARGS, True)
            else:
                node.update_kwarg("seq_major_h", True)
            refake(node)
            refake_downstream(node)


def _seq_major(node: torch.fx.Node) -> bool:
    return bool((named_arguments(node) or {}).get("seq_major_h", False))


def _h_readers_transpose(node: torch.fx.Node) -> bool:
    """Whether the op's outputs are read only by index and h's readers (at least one) all swap
    its head and position dims."""
    if not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
        return False
    readers = [r for item in node.users if item.args[1] == 0 for r in item.users]
    return bool(readers) and all(_swaps_heads_and_positions(r) for r in readers)


def _swaps_heads_and_positions(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or len(node.args) < 2:
        return False
    if node.target is torch.ops.aten.transpose.int and len(node.args) == 3:
        return {d % 4 for d in node.args[1:]} == {1, 2}
    if node.target is torch.ops.aten.permute.default:
        return [d % 4 for d in node.args[1]] == [0, 2, 1, 3]
    return False
