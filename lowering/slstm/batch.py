"""A symbolic batch size (torch.export's Dim, torch.compile's automatic dynamic shapes): the one
symbolic size a step may have, the leading dim of every input of the step that has it. The layouts
are measured at its example value and proven there and at one more (BATCH_PROOF); the op's views
read the size from a root at run time (`sym_size`). Other symbolic sizes are refused with the
reason: the layouts are measured at one size of them."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..proof import Refused
from .nodes import aten, example_shape, is_size, size_hint, static_shape, val
from .plans import Plan, StateMap, View, views

BATCH_PROOF = 1  # a symbolic batch size is proven at its example value and at that plus this


@dataclass
class BatchSize:
    """The steps' symbolic batch size and its example value."""
    symbol: object  # the sympy symbol
    hint: int


def _dims(n) -> list:
    v = val(n)
    return list(v.shape) if isinstance(v, torch.Tensor) else [v] if isinstance(v, torch.SymInt) else []


def batch_size(cells) -> BatchSize | None:
    """None where every size of the steps is static; else their batch size, or Refused where the
    symbolic sizes are more than one batch size leading every input of the step (the layouts are
    measured at one size). Inside the step a tensor may hold it anywhere: the proof runs at two
    of its values."""
    inputs = [n for c in cells for n in c.inputs]
    inside = [n for c in cells for n in c.region]
    sizes = [a for n in inside for a in n.all_input_nodes if is_size(a)]
    symbols, hint = set(), None
    for n in [*inputs, *inside, *sizes]:
        for k, d in enumerate(_dims(n)):
            if isinstance(d, int):
                continue
            symbols |= d.node.expr.free_symbols
            if n in inputs and (k or not d.node.expr.is_Symbol):
                raise Refused(f"dynamic shapes: the step's input {n.name} has the symbolic size {d} at dim {k} (only "
                              "a leading batch dim may be symbolic; compile with dynamic=False or mark the other sizes "
                              "static)")
            if d.node.expr.is_Symbol:
                hint = size_hint(d)
    if not symbols:
        return None
    if len(symbols) > 1:
        raise Refused(f"dynamic shapes: {len(symbols)} symbolic sizes ({', '.join(sorted(map(str, symbols)))}); "
                      "only one batch size may be symbolic")
    if hint is None or hint < 2:
        raise Refused("dynamic shapes: the symbolic batch size has no example value of 2 or more")
    return BatchSize(next(iter(symbols)), hint)


def leads_with(node, batch: BatchSize) -> bool:
    """The node is a tensor whose leading dim is the batch size."""
    v = val(node)
    return isinstance(v, torch.Tensor) and v.dim() > 0 and not isinstance(v.shape[0], int) \
        and v.shape[0].node.expr == batch.symbol


def check_batch_layouts(h, state: StateMap, Wx: Plan, R: Plan, b: Plan, roots, batch: BatchSize) -> None:
    """With a symbolic batch size the measured layouts must hold at every batch size: the batch
    is the outermost dim of the states (h, the step's new h), every root Wx reads is read batch row
    by batch row (_row_by_row), and R and b do not depend on it."""
    if state.B != batch.hint or not leads_with(h, batch) or (state.packed and state.packed[0] != 0):
        raise Refused("dynamic shapes: the states' batch rows are not their leading dim")
    for v in views(Wx):
        root = roots[v.root]
        if v.strides[0] == 0:
            if static_shape(root) is None:
                raise Refused("dynamic shapes: an input broadcast over the batch has a symbolic size")
            continue
        if not leads_with(root, batch) or not _row_by_row(v):
            raise Refused(f"dynamic shapes: Wx is read from {root.name} other than batch row by batch row")
    if any(static_shape(roots[v.root]) is None for plan in (R, b) for v in views(plan)):
        raise Refused("dynamic shapes: R or b has a symbolic size")


def _row_by_row(v: View) -> bool:
    """Batch row b of the view reads root row b only, at any batch size: a reshape and permutation
    with the batch outermost, or strides within one row of the root (its dims after the first)
    with the batch advancing by one row."""
    order = v.packed_order()
    if order is not None:
        return not order or order[0] == 0
    row = math.prod(v.root_shape[1:])
    reach = v.offset + sum((n - 1) * st for a, (n, st) in enumerate(zip(v.shape, v.strides)) if a)
    return v.strides[0] == row and reach < row


def proof_batches(batch: BatchSize | None) -> list:
    """The batch sizes a proof runs at: the example's (None), and one more where it is symbolic."""
    return [None] if batch is None else [None, batch.hint + BATCH_PROOF]


def state_at(state: StateMap, at: int | None) -> StateMap:
    """The state layout at batch size `at` (None: as measured)."""
    return state if at is None else replace(state, S=(at, *state.S[1:]), B=at)


def shape_at(node, batch: BatchSize | None, at: int | None) -> tuple:
    """The node's example shape, its leading batch dim at `at` where given."""
    s = example_shape(node) or ()
    return (at, *s[1:]) if at is not None and leads_with(node, batch) else s


def emit_batch_size(em, batch: BatchSize | None, nodes):
    """The batch size as a graph node (sym_size of the first of `nodes` leading with it), or None
    where it is static."""
    if batch is None:
        return None
    return em(aten.sym_size.int, next(n for n in nodes if leads_with(n, batch)), 0)


def describe_batch(batch: BatchSize | None) -> str:
    return "" if batch is None else f", batch size symbolic (proven at {batch.hint} and {batch.hint + BATCH_PROOF})"
