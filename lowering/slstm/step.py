"""Pattern "slstm_step": one hand-written sLSTM step (a decode function `step(x_t, state)`, a loop
of one step, a decoding loop whose next input depends on the last output) -> one
torch.ops.xaccel.slstm_step.

The step is found (core.py, cell.py), measured (measure.py) and proven (variants.py). The old h is
the tensor of the states' shape the gates are linear in (candidates nearest the gates first; the
proof decides). Steps that belong to a sequence loops.py collapses are left to it: this pass runs
first.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx

from torch_xaccel.report import Fallback, Replacement

from .. import PassContext
from ..graph_utils import location, mutated_nodes
from ..proof import NoMatch, Refused
from . import batch as Bt, loops, variants as V
from .cell import Cell, build_cell, escapes, extract, h_candidates, tensor_roots_refusal
from .core import Core, find_core, seeds
from .emit import Emitter, erase_dead, mark_reported
from .measure import Layout, measure, running
from .nodes import example_shape, is_zeros, val
from .plans import Zeros, batch_invariant, plan_of
from .prepare import prepare

FAMILY = "slstm_step"
aten = torch.ops.aten
REPORT_DEPTH = 4  # a failed walk is reported only once it found c' and n' (an mLSTM step stops before)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    if not prepare(graph):
        return
    # steps of a sequence are the slstm pattern's; with it switched off each step is replaced alone
    taken = loops.claimed(graph) if "slstm" in ctx.config.patterns else set()
    reported = set()  # one line per source line (a loop of steps the loop pass leaves)
    for mx in seeds(graph):
        if mx in taken or mx._erased:
            continue
        where = location(mx)
        try:
            _replace(gm, ctx, find_core(mx), where)
        except (NoMatch, Refused) as e:
            if isinstance(e, NoMatch) and e.depth < REPORT_DEPTH:
                continue
            mark_reported(getattr(e, "nodes", ()))
            if where not in reported:
                reported.add(where)
                ctx.report.fallbacks.append(Fallback(FAMILY, f"sLSTM-shaped step at {where}: {e}", where))


def _replace(gm, ctx, core: Core, where: str) -> None:
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    # the candidate that got furthest (proven beats measured beats unbuilt) and its nodes
    why, nodes = None, step_nodes(core)
    for h in h_candidates(core, order):
        cell = None
        try:
            cell = build_cell(core, h, order)
            variant, layout, ins, batch = _prove(graph, cell, ctx.training)
        except (NoMatch, Refused) as e:
            if why is None or _stage(e) > _stage(why):
                why, nodes = e, cell.region if cell is not None else nodes
            continue
        _emit(graph, cell, layout, ins, variant, order, batch)
        erase_dead(graph, cell.region)
        ctx.report.replacements.append(Replacement(FAMILY, "xaccel.slstm_step", f"sLSTM step, variant "
                                                   f"{V.describe(variant)}{Bt.describe_batch(batch)}", where))
        return
    refusal = Refused(str(why) if why else "no tensor of the states' shape that the gates are linear in (the old h)")
    refusal.nodes = nodes
    raise refusal


def _stage(e: Exception) -> int:
    """How far a candidate old h got: 0 no cell, 1 refused before its proof, 2 refused by it."""
    return 0 if isinstance(e, NoMatch) else 2 if getattr(e, "proven", False) else 1


def step_nodes(core: Core) -> list:
    """The update's nodes, from the gates and old states to the new ones (what a step that no cell
    could be built for marks as reported)."""
    stops = {*core.gates.values(), *core.old.values()}
    out, todo = set(), list(core.new.values())
    while todo:
        x = todo.pop()
        if x not in out and x not in stops and x.op == "call_function":
            out.add(x)
            todo.extend(x.all_input_nodes)
    return list(out)


def _check(graph, cell: Cell) -> None:
    if cell.shape is None:
        raise Refused("the states' shape has an unbacked size")
    odd = tensor_roots_refusal(cell)
    if odd:
        raise Refused(odd)
    dtype = val(cell.core.new["h"]).dtype
    if dtype not in (torch.float32, torch.float64) or any(
            val(n).dtype != dtype for n in (*cell.core.new.values(), *cell.core.old.values(), cell.h_old, *cell.roots)):
        raise Refused(f"the step computes in {dtype} or mixes dtypes (the op's state math is fp32 or fp64)")
    esc = escapes(cell, set())
    if esc:
        raise Refused(f"its intermediate {esc[0].name} is read elsewhere")
    written = mutated_nodes(graph)
    if any(n in written for n in (*cell.region, *cell.inputs)):
        raise Refused("a value of the step is written in place")


def _plans(cell: Cell, layout: Layout) -> tuple:
    """(Wx_t [B, 4, NH, D], R, b) plans over the cell's roots: batch-invariant additive roots
    are the bias, the rest Wx_t."""
    shapes = {j: example_shape(r) for j, r in enumerate(cell.roots)}
    wx = [t for t in layout.additive.values() if not batch_invariant(t)]
    bias = [(t[0][0], t[1][0]) for t in layout.additive.values() if batch_invariant(t)]
    state = layout.state
    Wx = plan_of(wx, shapes, [1, 2]) if wx else Zeros((state.B, 4, state.NH, state.D))
    b = plan_of(bias, shapes, [0, 1]) if bias else Zeros((4, state.NH, state.D))
    if Wx is None or b is None:
        raise Refused("the input term's layout is not a view of the step's inputs")
    return Wx, layout.R, b


def _prove(graph, cell: Cell, training: bool) -> tuple:
    _check(graph, cell)
    tie = V.tie_refusal(cell.core, cell.core.old["n"], training)
    if tie:
        raise Refused(tie)
    olds = cell.inputs[:4]
    distinct = len({id(x) for x in olds}) == 4
    if not distinct and not all(is_zeros(x) for x in olds):
        raise Refused("its states are one tensor")
    batch = Bt.batch_size([cell])
    with running("the step"):
        layout = measure(cell)
        ins = _plans(cell, layout)
        if batch is not None:
            Bt.check_batch_layouts(cell.core.new["h"], layout.state, *ins, cell.roots, batch)
        try:
            variant = _variant(cell, layout, ins, batch, distinct)
        except Refused as e:
            e.proven = True
            raise
    return variant, layout, ins, batch


def _variant(cell: Cell, layout: Layout, ins, batch, evidence: bool) -> tuple:
    """The op's variant the step computes (at every batch size the proof runs at), or Refused."""
    dtype = val(cell.core.new["h"]).dtype
    outs = [cell.core.new[r] for r in "hcnm"]
    agree = V.hypotheses(cell.core)
    for at in Bt.proof_batches(batch):
        fns = [extract(cell.region, cell.inputs, outs, dtype=d, batch=at) for d in (None, torch.float64)]

        def make_inputs(gen, at=at):
            vals = V.random_roots(cell, layout, gen, dtype, shape=lambda r: Bt.shape_at(r, batch, at))
            return vals, lambda cast: _op_inputs(ins, cast(vals[:len(cell.roots)]), at)

        proof = V.prove(fns, Bt.state_at(layout.state, at), dtype, make_inputs, agree, zero_states=not evidence)
        if not proof.agree:
            raise Refused(proof.differs("it" if at is None else f"at batch size {at} it"))
        agree = proof.agree
    variant = V.choose(agree, math.prod(layout.state.op_shape), evidence)
    if variant[0] == V.NO_RULE:
        if variant[2]:
            raise Refused("no fresh rule and n clamped at 1: no variant of xaccel.slstm_step computes it")
        region = set(cell.region)
        if any(u not in region for r in "cnm" for u in cell.core.new[r].users):
            raise Refused("no fresh rule: its h equals xaccel.slstm_step's, but its c, n, m carry another "
                          "stabilizer and the graph reads them")
        variant = ("element", False, False)
    return variant


def _op_inputs(ins, roots, at) -> list:
    """Wx_t, R, b from the root values."""
    Wx, R, b = ins
    return [Wx.run(roots, roots[0], at), R.run(roots, roots[0]), b.run(roots, roots[0])]


def _emit(graph, cell: Cell, layout: Layout, ins, variant, order, batch=None) -> None:
    """The op right after its last input; the new states viewed back to the user's layout."""
    region = set(cell.region)
    inputs = [*cell.roots, *cell.inputs[:4]]
    last = max(inputs, key=order.__getitem__)
    outs = {r: cell.core.new[r] for r in "hcnm"}
    users = [u for o in outs.values() for u in o.users if u not in region]
    if any(order[u] <= order[last] for u in users):
        raise Refused("a result is read before all of the step's inputs exist")
    em = Emitter(graph, cell.core.max)
    state = layout.state
    with graph.inserting_before(last.next):
        like = cell.roots[0]
        B = Bt.emit_batch_size(em, batch, inputs)  # None where the batch size is static
        Wx = ins[0].emit(em, cell.roots, like, B)
        R, b = (p.emit(em, cell.roots, like) for p in ins[1:])
        olds = [state.emit(em, x, True, batch=B) for x in cell.inputs[:4]]
        op = em(torch.ops.xaccel.slstm_step.default, Wx, R, b, *olds, *variant)
        for j, r in enumerate("hcnm"):
            outside = {u for u in outs[r].users if u not in region}
            if outside:
                new = state.emit(em, em(operator.getitem, op, j), False, batch=B)
                outs[r].replace_all_uses_with(new, delete_user_cb=lambda u, o=outside: u in o)
