"""Gradient sums in backward graphs that run eagerly: `rewrite` turns a sum of slice_backward
results that tile one dimension into one concatenation; `fold_into_producers` moves a sum into the
xaccel op that computes one of its terms.

Where a forward reads one tensor as slices (`y[..., :4]` and `y[..., 4:]`: the two gates that the
skinny_linear pass cuts from its stacked output, in every mLSTM block), autograd's backward pads
each slice's gradient with zeros to the full shape (`slice_backward`: a fill and a copy each) and
adds the padded tensors: five kernels where one `cat` writes the same values. Inductor folds this
itself; the eager rest would launch them all, and a host-bound train step pays per launch.
(`chunk` and `split` need nothing: their backward is a cat already.)

Rewritten only where the sum is exact: step-1 slices of one dimension with static sizes that
cover it without gaps or overlaps, every part in the sum's dtype, each intermediate result read
by the sum alone. Adding zeros changes no value, so the concatenation is equal element for element.

Where a forward value feeds several ops, autograd adds their gradients: `dx = dx_a + dx_b`, one
more kernel that reads both and writes the sum (in the xlstm package's mLSTM blocks, six such sums
of the inner width per block: the q, k and v gradients of the mLSTM and of its gate projection,
the convolution output's three consumers, the up-projection's two). Where dx_a is an output of an
op that takes an addend (families.ADDEND_ARGS: the op adds it before rounding its output), the sum
becomes that argument: the op writes dx_a + dx_b in the same pass over memory, and the add is gone.
Folded only where the other term can be computed before the op (it is, or the op's outputs are
read only after it: the op moves there), the shapes and dtypes agree without broadcasting, and the
op's output reaches the sum through views alone, read by nothing else.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

aten = torch.ops.aten


def _only_user(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    return len(node.users) == 1 and user in node.users


def _terms(add: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The slice_backward nodes a tree of adds sums (each inner add read by its parent alone), or None."""
    if add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    terms = []
    for arg in add.args:
        if not isinstance(arg, torch.fx.Node) or not _only_user(arg, add):
            return None
        if arg.op == "call_function" and arg.target is aten.add.Tensor:
            inner = _terms(arg)
            if inner is None:
                return None
            terms += inner
        elif arg.op == "call_function" and arg.target is aten.slice_backward.default:
            terms.append(arg)
        else:
            return None
    return terms


def _tiling(terms: list[torch.fx.Node], out) -> tuple[int, list[torch.fx.Node]] | None:
    """(dim, the gradients in order along it) when the terms' slices tile one dimension of `out`."""
    if any(len(t.args) != 6 or t.kwargs for t in terms):
        return None
    first = terms[0].args
    sizes, dim = list(first[1]), first[2]
    if not all(isinstance(s, int) for s in sizes) or list(out.shape) != sizes:
        return None
    dim %= len(sizes)
    ranges = []
    for t in terms:
        grad, t_sizes, t_dim, start, _end, step = t.args
        g = grad.meta.get("val") if isinstance(grad, torch.fx.Node) else None
        if g is None or list(t_sizes) != sizes or t_dim % len(sizes) != dim or step != 1:
            return None
        if g.dtype != out.dtype or not isinstance(g.shape[dim], int) or not isinstance(start, int):
            return None
        start = min(max(start + sizes[dim] if start < 0 else start, 0), sizes[dim])
        ranges.append((start, start + g.shape[dim], grad))
    ranges.sort(key=lambda r: r[0])
    edge = 0
    for start, end, _ in ranges:
        if start != edge:
            return None
        edge = end
    return (dim, [g for _, _, g in ranges]) if edge == sizes[dim] else None


def _erase_dead(node: torch.fx.Node) -> None:
    """Erase node and then each of its inputs that nothing else reads (the replaced sum's tree)."""
    inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
    node.graph.erase_node(node)
    for a in inputs:
        if not a.users and a.target in (aten.add.Tensor, aten.slice_backward.default):
            _erase_dead(a)


def rewrite(g: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replace each such sum in g (in place); returns g."""
    changed = False
    for node in list(g.graph.nodes):
        # (a replaced sum's inner adds come before it in the graph: none is visited after erasure)
        if node.op != "call_function" or node.target is not aten.add.Tensor:
            continue
        out = node.meta.get("val")
        terms = _terms(node) if isinstance(out, torch.Tensor) and out.is_contiguous() else None
        tiled = _tiling(terms, out) if terms and len(terms) >= 2 else None
        if tiled is None:
            continue
        dim, grads = tiled
        with g.graph.inserting_before(node):
            cat = g.graph.call_function(aten.cat.default, (grads, dim))
        cat.meta.update(node.meta)
        node.replace_all_uses_with(cat)
        _erase_dead(node)
        changed = True
    if changed:
        g.recompile()
    return g


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_LAYOUT_VIEWS = (*_VIEWS, aten.transpose.int, aten.permute.default, aten.t.default, aten.unsqueeze.default,
                 aten.squeeze.dim)


def _call(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _producer(term: torch.fx.Node, ops) -> tuple[torch.fx.Node, int | None] | None:
    """(op node, output index or None) when term is an op's output seen through views, each
    value on the way read by the next alone; else None."""
    node = term
    while True:
        if len(node.users) != 1:
            return None
        if not _call(node, _VIEWS):
            break
        node = node.args[0]
    index = None
    if _call(node, (operator.getitem,)):
        node, index = node.args
    return (node, index) if _call(node, ops) else None


def _slot(op: torch.fx.Node, name: str, index: int | None):
    """(argument position, its current value) of the op's addend argument for that output, or None
    when the argument's form does not fit the output (Tensor? for a single output, Tensor?[] for a
    list) or the slot is taken."""
    arguments = op.target._schema.arguments
    pos = next((i for i, a in enumerate(arguments) if a.name == name), None)
    if pos is None:
        return None
    current = op.kwargs.get(name, op.args[pos] if pos < len(op.args) else None)
    if index is None:
        return (pos, current) if current is None and isinstance(arguments[pos].type, torch.OptionalType) else None
    if not isinstance(current, (list, tuple)) or not 0 <= index < len(current) or current[index] is not None:
        return None
    return pos, current


def _hoist(node: torch.fx.Node, before: torch.fx.Node, order: dict) -> bool:
    """Move node, a chain of views over a value computed before `before`, to just before it."""
    chain = []
    while order[node] > order[before]:
        if not _call(node, _LAYOUT_VIEWS) or node.all_input_nodes != [node.args[0]]:
            return False
        chain.append(node)
        node = node.args[0]
    for n in reversed(chain):
        before.prepend(n)
    return True


def _sink(op: torch.fx.Node, term: torch.fx.Node, after: torch.fx.Node, order: dict) -> bool:
    """Move op, its getitems and the views from it to term to just after `after`, when nothing
    else reads its outputs before."""
    chain = [term]
    while chain[-1].args and chain[-1].args[0] is not op and _call(chain[-1], _VIEWS + (operator.getitem,)):
        chain.append(chain[-1].args[0])
    items = [u for u in op.users if _call(u, (operator.getitem,))]
    moved = {op, *items, *chain}
    readers = [r for n in (op, *items, *chain) for r in n.users if r not in moved]
    if any(order[r] <= order[after] for r in readers):
        return False
    at = after
    for n in sorted(moved, key=order.__getitem__):
        at.append(n)
        at = n
    return True


def _fold(g: torch.fx.GraphModule, add: torch.fx.Node, ops: dict) -> bool:
    out = add.meta.get("val")
    if add.kwargs or len(add.args) != 2 or not isinstance(out, torch.Tensor):
        return False
    a, b = add.args
    if not all(isinstance(t, torch.fx.Node) and isinstance(t.meta.get("val"), torch.Tensor) for t in (a, b)):
        return False
    if any(t.meta["val"].shape != out.shape or t.meta["val"].dtype != out.dtype for t in (a, b)):
        return False
    for term, other in ((a, b), (b, a)):
        found = _producer(term, ops)
        if found is None:
            continue
        op, index = found
        slot = _slot(op, ops[op.target], index)
        produced = op.meta.get("val")
        produced = produced[index] if index is not None and isinstance(produced, (list, tuple)) else produced
        if slot is None or not isinstance(produced, torch.Tensor) or produced.dtype != out.dtype:
            continue
        order = {n: i for i, n in enumerate(g.graph.nodes)}
        if order[other] > order[op] and not _hoist(other, op, order) and not _sink(op, term, other, order):
            continue
        addend = other
        if tuple(produced.shape) != tuple(out.shape):
            with g.graph.inserting_before(op):
                addend = g.graph.call_function(aten.reshape.default, (other, list(produced.shape)))
            addend.meta["val"] = other.meta["val"].reshape(produced.shape)
        pos, current = slot
        value = addend if index is None else [addend if j == index else v for j, v in enumerate(current)]
        if pos < len(op.args):
            op.update_arg(pos, value)
        else:
            op.update_kwarg(ops[op.target], value)
        add.replace_all_uses_with(term)
        g.graph.erase_node(add)
        return True
    return False


def fold_into_producers(g: torch.fx.GraphModule, addend_args: dict) -> torch.fx.GraphModule:
    """Fold each such sum in g into the op computing one of its terms (in place); returns g.
    addend_args: OpOverload -> the name of its addend argument."""
    changed = False
    for node in list(g.graph.nodes):
        if node.op == "call_function" and node.target is aten.add.Tensor:
            changed |= _fold(g, node, addend_args)
    if changed:
        g.graph.lint()
        g.recompile()
    return g
