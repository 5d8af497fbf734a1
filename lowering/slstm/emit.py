"""Writing the replacement into the graph."""
from __future__ import annotations

import torch
import torch.fx
from torch.fx import Node

from ..graph_utils import REPORTED_REGION
from .nodes import val


class Emitter:
    """graph.call_function with the fake value computed (later passes read meta["val"]) and the
    user's stack trace carried (reports point at the source line)."""

    def __init__(self, graph: torch.fx.Graph, like: Node):
        self.graph = graph
        self.fake_mode = getattr(val(like), "fake_mode", None)
        self.trace = like.meta.get("stack_trace")

    def __call__(self, target, *args, **kwargs) -> Node:
        node = self.graph.call_function(target, args, kwargs)
        if self.trace:
            node.meta["stack_trace"] = self.trace
        if self.fake_mode is not None:
            with self.fake_mode:
                fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), val)
                node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node


def erase_dead(graph: torch.fx.Graph, candidates) -> None:
    """Erase the candidates left without users (latest first), except side-effecting nodes."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted((c for c in set(candidates) if c in order), key=order.__getitem__, reverse=True):
        if not n.users and n.op == "call_function" and not n.is_impure():
            graph.erase_node(n)


def mark_reported(nodes, family: str = "slstm") -> None:
    """The nodes of a refused sLSTM-looking step or loop, reported once: later passes (the mLSTM
    proof, the GEMM pass) neither report nor analyse them again."""
    for n in nodes:
        n.meta[REPORTED_REGION] = family
