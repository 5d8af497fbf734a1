"""What the sLSTM passes do to a graph before they look for steps: a cheap filter, then two
rewrites that leave every value as it was but let one structural walk see the step however it
was spelled."""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import mutated_nodes
from .nodes import MAX, aten, val

# elementwise ops without the pointwise tag that a step computes
_PURE = {aten.log_sigmoid.default, aten.softplus.default, aten.all.default, aten.any.default}


def looks_like_slstm(graph: torch.fx.Graph) -> bool:
    """Exponential gating stabilized by a running max, and two squashing activations. Graphs
    without them cost one pass over their nodes. (No logsigmoid is required: a step with an
    exponential forget gate is found, to be refused by name.)"""
    seen = {"exp": 0, "max": 0, "act": 0}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is aten.exp.default:
            seen["exp"] += 1
        elif n.target in MAX:
            seen["max"] += 1
        elif n.target in (aten.tanh.default, aten.sigmoid.default):
            seen["act"] += 1
    return seen["exp"] >= 2 and seen["max"] >= 1 and seen["act"] >= 2


def prepare(graph: torch.fx.Graph) -> bool:
    """False where the graph holds no sLSTM step; else the rewrites below are made."""
    if not looks_like_slstm(graph):
        return False
    fold_same_dtype_casts(graph)
    fold_repeated(graph)
    return True


def fold_same_dtype_casts(graph: torch.fx.Graph) -> None:
    """x.to(x.dtype) returns x itself, so the node is replaced by x. Code that casts its states
    every step (`c = c.to(Wx.dtype)`) then chains its steps directly, and each h stacked is the
    step's own h."""
    for n in list(graph.find_nodes(op="call_function", target=aten.to.dtype)):
        x = n.args[0]
        extra = list(n.args[2:]) + list(n.kwargs.values())
        if isinstance(val(x), torch.Tensor) and val(n).dtype == val(x).dtype and not any(extra):
            n.replace_all_uses_with(x)
            graph.erase_node(n)


def _pure(target) -> bool:
    if target in _PURE:
        return True
    tags = getattr(target, "tags", ())
    return (torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags
            and not target._schema.is_mutable)


def _key(x):
    """A hashable spelling of an argument: nodes by identity, scalars with their type (x * 1 and
    x * 1.0 differ for integer x)."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *map(_key, x))
    if isinstance(x, dict):
        return tuple(sorted((k, _key(a)) for k, a in x.items()))
    if isinstance(x, (torch.fx.Node, str, torch.dtype, torch.device, type(None))):
        return x
    if isinstance(x, (bool, int, float)):
        return (type(x), x)
    raise TypeError(type(x))  # symbolic sizes and the rest: not compared


def _gating(graph: torch.fx.Graph) -> set:
    """The exponential gates of the steps and the elementwise nodes they are computed from, as far
    as they connect to a max: exp(i - m'), exp(F + m - m'), m' itself, F + m. Not what the gates
    multiply: where a start state is one tensor (h = c = n = m = zeros), f' c and f' n are the
    same expression in the first step only, and merging them would set it apart from the next."""
    island, todo = set(), [n for t in MAX for n in graph.find_nodes(op="call_function", target=t)]
    while todo:
        x = todo.pop()
        if x in island or x.op != "call_function" or not _pure(x.target):
            continue
        island.add(x)
        todo.extend(x.all_input_nodes)
        todo.extend(x.users)
    out, todo = set(), [n for n in island if n.target is aten.exp.default]
    while todo:
        x = todo.pop()
        if x in island and x not in out:
            out.add(x)
            todo.extend(x.all_input_nodes)
    return out


def fold_repeated(graph: torch.fx.Graph) -> None:
    """An elementwise expression of the gating (_gating) computed twice from the same arguments
    becomes one node. The textbook step writes logsigmoid(f) + m twice (in m' = max(logsigmoid(f)
    + m, i) and in f' = exp(logsigmoid(f) + m - m')), or exp(logfm - m') once per use; the
    structural walk follows one node per value. Values written in place, and what reads them, stay
    apart."""
    island = _gating(graph)
    written = mutated_nodes(graph) if island else set()
    first: dict = {}
    for n in list(graph.nodes):
        if n not in island or n in written or any(a in written for a in n.all_input_nodes):
            continue
        try:
            key = (n.target, _key(n.args), _key(n.kwargs))
            seen = first.setdefault(key, n)
        except TypeError:
            continue
        if seen is not n:
            n.replace_all_uses_with(seen)
            graph.erase_node(n)
