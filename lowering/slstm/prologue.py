"""A loop whose first step is written apart: `if t == 0:` in the loop body, the first step using
zero or no state, skipping the recurrent product, or setting m = i, c = tanh(z), n = 1 itself.
Dynamo unrolls the branch, so the graph holds that step's own nodes, then a chain of identical
steps (loops.py) whose first old states they compute.

`find` takes those nodes: everything the chain's first old states are computed from, back to
what the chain itself reads (its roots and their inputs). Each input the chain computes anew at
every step (x[:, t] @ W) must have its first step's counterpart among them: the same computation
with every time index one less (`time_shift`). loops.py then proves them against the op's first
step from no state (reference.step from zeros, on the entries of Wx its plans put at the step
before the chain's first) and, where that holds, collapses the loop from its first step with no
initial state; else from the second, the first step's states given. (A chain has two steps or
more: in a loop of two steps, the second is step.py's.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.utils._pytree as pytree
from torch.fx import Node

from .cell import Cell
from .nodes import FACTORIES, MAX, TIME_ARGS, example_shape, is_op, is_size, is_zeros

SIZE = 3  # a first step has at most this many times a later step's nodes (plus MARGIN)
MARGIN = 16


@dataclass
class Prologue:
    nodes: list  # the first step's nodes, in graph order
    inputs: list  # what they read from outside: the chain's roots, counterparts, shape-only reads
    states: list  # the h, c, n, m it computes: the chain's first old states
    counterparts: dict  # per-step root slot -> the first step's node in its place

    def seeds(self) -> list:
        """Its max nodes (a step written with a max is one core.seeds finds)."""
        return [n for n in self.nodes if is_op(n, *MAX)]


def time_shift(a: Node, b: Node, memo: dict | None = None) -> set | None:
    """The set of (b's time index - a's) where a and b are the same computation of the same
    inputs but for time indices (set(): the same node); None where they differ otherwise."""
    memo = {} if memo is None else memo
    if a is b:
        return set()
    if (a, b) in memo:
        return memo[(a, b)]
    memo[(a, b)] = None
    if a.op != "call_function" or b.op != "call_function" or a.target != b.target \
            or example_shape(a) != example_shape(b):
        return None
    fa, sa = pytree.tree_flatten((a.args, a.kwargs))
    fb, sb = pytree.tree_flatten((b.args, b.kwargs))
    if sa != sb:
        return None
    shifts = set()
    for p, (u, v) in enumerate(zip(fa, fb)):
        if isinstance(u, Node) and isinstance(v, Node):
            sub = time_shift(u, v, memo)
            if sub is None:
                return None
            shifts |= sub
        elif u != v:
            if not (type(u) is int and type(v) is int and p in TIME_ARGS.get(a.target, ())):
                return None
            shifts.add(v - u)
    memo[(a, b)] = shifts
    return shifts


def _ancestors(nodes) -> set:
    seen, todo = set(), list(nodes)
    while todo:
        x = todo.pop()
        if x not in seen:
            seen.add(x)
            todo.extend(x.all_input_nodes)
    return seen


def _closure(outputs, stops: set, limit: int) -> list | None:
    """The nodes `outputs` are computed from, back to `stops` and the graph's inputs; None past
    `limit` nodes."""
    out, todo = set(), list(outputs)
    while todo:
        x = todo.pop()
        if x in out or x in stops or x.op != "call_function":
            continue
        out.add(x)
        if len(out) > limit:
            return None
        todo.extend(x.all_input_nodes)
    return list(out)


def _shape_only(node: Node, inside: set) -> bool:
    """The node is read inside `inside` only for its shape (by factories such as zeros_like)."""
    return all(is_op(u, *FACTORIES) for u in node.users if u in inside)


def find(cells: list, shared: list, order) -> Prologue | None:
    """The first step written apart before the chain `cells` (shared: per root slot, whether every
    step reads the same tensor), or None."""
    first: Cell = cells[0]
    states = first.inputs[:4]
    if len(set(states)) != 4 or any(x.op != "call_function" or is_zeros(x) for x in states):
        return None
    upstream = _ancestors({r for c in cells for r in c.roots})
    if any(x in upstream for x in states):
        return None
    limit = SIZE * len(first.region) + MARGIN
    nodes = _closure(states, upstream, limit)
    if nodes is None:
        return None
    counterparts = {}
    for j, same in enumerate(shared):
        if not same:
            mine = next((n for n in nodes if time_shift(n, first.roots[j]) == {1}), None)
            if mine is None:
                return None
            counterparts[j] = mine
    if counterparts:
        nodes = _closure(states, upstream | set(counterparts.values()), limit)
    inside = set(nodes)
    inputs = sorted({a for n in nodes for a in n.all_input_nodes if a not in inside and not is_size(a)},
                    key=order.__getitem__)
    known = {r for c in cells for r in c.roots} | set(counterparts.values())
    if any(a not in known and not _shape_only(a, inside) for a in inputs):
        return None  # it reads what the op's inputs do not give: not the loop's first step
    return Prologue(sorted(nodes, key=order.__getitem__), inputs, list(states), counterparts)
