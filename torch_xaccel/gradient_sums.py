"""Backward graphs that run eagerly: a sum of slice_backward results that tile one dimension
becomes one concatenation.

Where a forward reads one tensor as slices (`y[..., :4]` and `y[..., 4:]`: the two gates that the
skinny_linear pass cuts from its stacked output, in every mLSTM block), autograd's backward pads
each slice's gradient with zeros to the full shape (`slice_backward`: a fill and a copy each) and
adds the padded tensors: five kernels where one `cat` writes the same values. Inductor folds this
itself; the eager rest would launch them all, and a host-bound train step pays per launch.
(`chunk` and `split` need nothing: their backward is a cat already.)

Rewritten only where the sum is exact: step-1 slices of one dimension with static sizes that
cover it without gaps or overlaps, every part in the sum's dtype, each intermediate result read
by the sum alone. Adding zeros changes no value, so the concatenation is equal element for element.
"""
from __future__ import annotations

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
