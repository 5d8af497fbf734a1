"""One step as a whole: its core (core.py) plus the pre-activation, the nodes linear in the old h
between it and the gates. What else the pre-activation reads (a slice of Wx, R, b, a projection)
are the cell's roots, taken up through views to the tensor viewed, so that a time slice Wx[:, t]
has Wx itself as its root. The cell's nodes run as a function of their own (`extract`) to be
measured and proven."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch.fx import Node

from .. import proof
from ..proof import NoMatch
from .core import Core
from .nodes import FACTORIES, LINEAR, VIEWS, example_shape, is_op, is_size, size_hint, val

MAX_ROOT = 1 << 26  # a root is taken up through views only while the viewed tensor stays this small


@dataclass(eq=False)
class Cell:
    core: Core
    h_old: Node
    region: list  # every node of the step, in graph order
    roots: list  # what the pre-activation reads besides h (Wx, R, b, ...), in first-use order
    consts: list  # tensors read only for their shape (ones_like(x) of an outside x)
    pre: list  # the pre-activation's nodes (h and roots -> gates), in graph order
    shape: tuple  # the states' and gates' shape S

    @property
    def inputs(self) -> list:
        return [self.h_old, self.core.old["c"], self.core.old["n"], self.core.old["m"], *self.roots, *self.consts]

    def dependent(self) -> set:
        """Region nodes that depend on the old states (the rest are views of roots)."""
        states = {self.h_old, *self.core.old.values()}
        out = set()
        for n in self.region:
            if any(a in states or a in out for a in n.all_input_nodes):
                out.add(n)
        return out


def _linear_closure(h: Node, gates, order) -> set | None:
    """Nodes on linear-op paths from h to the gates (h excluded); None when a gate is not on one.
    Only nodes placed before the last gate can be on such a path."""
    limit = max(order[g] for g in gates)
    fwd, todo = {h}, [h]
    while todo:
        for u in todo.pop().users:
            if u not in fwd and order.get(u, limit + 1) <= limit and is_op(u, *LINEAR):
                fwd.add(u)
                todo.append(u)
    if any(g not in fwd for g in gates):
        return None
    keep, todo = set(), list(gates)
    while todo:
        x = todo.pop()
        if x in keep or x is h:
            continue
        keep.add(x)
        todo.extend(a for a in x.all_input_nodes if a in fwd)
    return keep


def _viewed(node):
    """The tensor `node` views (a view, copy or dtype cast of one tensor), or None."""
    if not is_op(node, *VIEWS) or len(node.all_input_nodes) != 1 or node.all_input_nodes[0] is not node.args[0]:
        return None
    src = node.args[0]
    v = val(src)
    if isinstance(v, (tuple, list)):  # getitem of unbind/split: the tuple's source is the tensor
        return src if all(isinstance(t, torch.Tensor) and isinstance(t.numel(), int) for t in v) else None
    return src if isinstance(v, torch.Tensor) and isinstance(v.numel(), int) and v.numel() <= MAX_ROOT else None


def _roots(pre: set, h: Node, order) -> tuple[list, set]:
    """(roots in first-use order, the view nodes between roots and the pre-activation)."""
    roots, views = [], set()
    for n in sorted(pre, key=order.__getitem__):
        for a in n.all_input_nodes:
            if a in pre or a is h or a in views or is_size(a):
                continue
            r = a
            while (src := _viewed(r)) is not None:
                views.add(r)
                r = src
            if r not in roots:
                roots.append(r)
    return roots, views


def _core_region(core: Core, h_old: Node, order) -> tuple[set, list]:
    """(the update's nodes from the gates and old states to the new states, the outside tensors
    read only for their shape by factories such as ones_like)."""
    stops = {*core.gates.values(), *core.old.values(), h_old}
    lo = min(order[x] for x in stops)
    region, consts, todo = set(), [], list(core.new.values())
    while todo:
        x = todo.pop()
        if x in region or x in stops:
            continue
        if is_op(x, *FACTORIES):
            region.add(x)
            consts.extend(a for a in x.all_input_nodes if a not in stops and a not in consts)
            continue
        if x.op != "call_function" or order[x] < lo:
            raise NoMatch(f"the update reads {x.name}, not only its gates and states", 5)
        region.add(x)
        todo.extend(x.all_input_nodes)
    consts = [c for c in consts if c not in region]
    return region, consts


def build_cell(core: Core, h_old: Node, order) -> Cell:
    pre = _linear_closure(h_old, list(core.gates.values()), order)
    if pre is None:
        raise NoMatch(f"the gates are not linear in {h_old.name}", 5)
    roots, views = _roots(pre, h_old, order)
    update, consts = _core_region(core, h_old, order)
    pre_nodes = sorted(pre | views, key=order.__getitem__)
    region = sorted(set(pre_nodes) | update, key=order.__getitem__)
    shape = example_shape(core.new["h"])
    cell = Cell(core, h_old, region, roots, consts, pre_nodes, shape)
    known = set(region) | set(cell.inputs)
    stray = [a.name for n in region for a in n.all_input_nodes if a not in known and not is_size(a)]
    if stray:
        raise NoMatch(f"the step reads {stray[0]} from outside", 5)
    return cell


def h_candidates(core: Core, order) -> list:
    """Nodes that may be the old h: tensors of the states' shape from which the gates are reached
    by linear ops, nearest first."""
    shape = example_shape(core.new["h"])
    seen, out, frontier = set(core.gates.values()), [], list(core.gates.values())
    while frontier:
        nxt = []
        for x in frontier:
            for a in x.all_input_nodes if is_op(x, *LINEAR) else ():
                if a in seen:
                    continue
                seen.add(a)
                if example_shape(a) == shape and a not in out:
                    out.append(a)
                nxt.append(a)
        frontier = nxt
    olds = set(core.old.values())  # an old c, n or m only where one tensor starts every state
    return [a for a in out if a not in olds] + [a for a in out if a in olds]


def escapes(cell: Cell, allowed: set) -> list:
    """State-dependent step nodes read outside the step (besides the new states and `allowed`)."""
    region = set(cell.region)
    outs = set(cell.core.new.values())
    return [n for n in cell.dependent() if n not in outs and any(u not in region and u not in allowed for u in n.users)]


def tensor_roots_refusal(cell: Cell) -> str | None:
    """Why the step's roots are not all tensors (a root left as a tuple of tensors, where a
    symbolic size stops the walk up through views), or None."""
    odd = next((r for r in cell.roots if not isinstance(val(r), torch.Tensor)), None)
    return None if odd is None else f"the step reads {odd.name}, a {type(val(odd)).__name__} of tensors, as one input"


def extract(nodes, inputs, outputs, dtype: torch.dtype | None = None, batch: int | None = None
            ) -> torch.fx.GraphModule:
    """The nodes as a callable of `inputs` (one argument each, duplicates allowed) returning
    `outputs`. With `dtype`, every floating dtype in their arguments becomes that one
    (proof.in_dtype: the step's math at float64). The symbolic sizes the nodes read become ints:
    their example values, or `batch` for a symbolic batch size (see batch.BatchSize)."""
    g = torch.fx.Graph()
    env = {}

    def arg(a):
        if a in env:
            return env[a]
        if is_size(a):
            return batch if batch is not None else size_hint(val(a))
        raise KeyError(a)
    for k, x in enumerate(inputs):
        env.setdefault(x, g.placeholder(f"in{k}"))
    for n in nodes:
        if n in env:
            continue
        env[n] = g.node_copy(n, arg)
        if dtype is not None:
            env[n].args = proof.in_dtype(env[n].args, dtype)
            env[n].kwargs = proof.kwargs_in_dtype(n, env[n].kwargs, dtype)
    g.output(tuple(env[o] for o in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), g)
