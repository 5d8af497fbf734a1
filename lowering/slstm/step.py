"""Pattern "slstm_step": one hand-written sLSTM step (a decode function `step(x_t, state)`, a loop
of one step, a decoding loop whose next input depends on the last output) -> one
torch.ops.xaccel.slstm_step.

The step is found, measured and proven as in cell.py. The old h is the tensor of the states'
shape the gates are linear in (candidates nearest the gates first; the proof decides). Steps that
belong to a sequence loops.py collapses are left to it: this pass runs first.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx

from torch_xaccel.report import Fallback, Replacement

from .. import PassContext
from ..graph_utils import location, mutated_nodes
from . import cell as C, loops
from .cell import NoMatch, Refused, val

FAMILY = "slstm_step"
aten = torch.ops.aten
REPORT_DEPTH = 4  # a failed walk is reported only once it found c' and n' (an mLSTM step stops before)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    if not C.looks_like_slstm(graph):
        return
    C.fold_same_dtype_casts(graph)
    # steps of a sequence are the slstm pattern's; with it switched off each step is replaced alone
    taken = loops.claimed(graph) if "slstm" in ctx.config.patterns else set()
    reported = set()
    for L in list(graph.find_nodes(op="call_function", target=aten.log_sigmoid.default)):
        if L in taken:
            continue
        where = location(L)
        try:
            core = C.find_core(L)
            _replace(gm, ctx, core, where)
        except (NoMatch, Refused) as e:
            if isinstance(e, NoMatch) and e.depth < REPORT_DEPTH or where in reported:
                continue
            reported.add(where)
            ctx.report.fallbacks.append(Fallback(FAMILY, f"sLSTM-shaped step at {where}: {e}", where))


def _replace(gm, ctx, core: C.Core, where: str) -> None:
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    why = None  # the reason of the candidate that got furthest: measured (Refused) beats unbuilt
    for h in C.h_candidates(core, order):
        try:
            cell = C.build_cell(core, h, order)
            variant, layout, ins, batch = _prove(graph, cell, ctx.training)
        except (NoMatch, Refused) as e:
            if why is None or (isinstance(e, Refused) and not isinstance(why, Refused)):
                why = e
            continue
        _emit(graph, cell, layout, ins, variant, order, batch)
        C.erase_dead(graph, cell.region)
        ctx.report.replacements.append(Replacement(FAMILY, "xaccel.slstm_step", f"sLSTM step, variant "
                                                   f"{C.describe(variant)}{C.describe_batch(batch)}", where))
        return
    raise Refused(str(why) if why else "no tensor of the states' shape that the gates are linear in (the old h)")


def _check(graph, cell: C.Cell) -> None:
    if cell.shape is None:
        raise Refused("the states' shape has an unbacked size")
    odd = C.tensor_roots_refusal(cell)
    if odd:
        raise Refused(odd)
    dtype = val(cell.core.new["h"]).dtype
    if dtype not in (torch.float32, torch.float64) or any(
            val(n).dtype != dtype for n in (*cell.core.new.values(), *cell.core.old.values(), cell.h_old, *cell.roots)):
        raise Refused(f"the step computes in {dtype} or mixes dtypes (the op's state math is fp32 or fp64)")
    esc = C.escapes(cell, set())
    if esc:
        raise Refused(f"its intermediate {esc[0].name} is read elsewhere")
    written = mutated_nodes(graph)
    if any(n in written for n in (*cell.region, *cell.inputs)):
        raise Refused("a value of the step is written in place")


def _plans(cell: C.Cell, layout: C.Layout) -> tuple:
    """(Wx_t [B, 4, NH, D], R, b) plans over the cell's roots: batch-invariant additive roots
    are the bias, the rest Wx_t."""
    shapes = {j: C.example_shape(r) for j, r in enumerate(cell.roots)}
    wx = [t for t in layout.additive.values() if not C.batch_invariant(t)]
    bias = [(t[0][0], t[1][0]) for t in layout.additive.values() if C.batch_invariant(t)]
    state = layout.state
    Wx = C.plan_of(wx, shapes, [1, 2]) if wx else C.Zeros((state.B, 4, state.NH, state.D))
    b = C.plan_of(bias, shapes, [0, 1]) if bias else C.Zeros((4, state.NH, state.D))
    if Wx is None or b is None:
        raise Refused("the input term's layout is not a view of the step's inputs")
    return Wx, layout.R, b


def _prove(graph, cell: C.Cell, training: bool) -> tuple:
    _check(graph, cell)
    tie = C.tie_refusal(cell.core, cell.core.old["n"], training)
    if tie:
        raise Refused(tie)
    olds = cell.inputs[:4]
    distinct = len({id(x) for x in olds}) == 4
    if not distinct and not all(C.is_zeros(x) for x in olds):
        raise Refused("its states are one tensor")
    batch = C.batch_size([cell])
    with C.running("the step"):
        layout = C.measure(cell)
        ins = _plans(cell, layout)
        if batch is not None:
            C.check_batch_layouts(cell.core.new["h"], layout.state, *ins, cell.roots, batch)
        dtype = val(cell.core.new["h"]).dtype
        agree = list(C.VARIANTS)
        for at in C.proof_batches(batch):
            fn = C.extract(cell.region, cell.inputs, [cell.core.new[r] for r in "hcnm"], batch=at)

            def make_inputs(gen, at=at):
                vals = C.random_roots(cell, layout, gen, dtype, shape=lambda r, at=at: C.shape_at(r, batch, at))
                roots = vals[:len(cell.roots)]
                Wx, R, b = ins
                return vals, Wx.run(roots, roots[0], at), R.run(roots, roots[0]), b.run(roots, roots[0])

            proof = C.prove(fn, C.state_at(layout.state, at), dtype, make_inputs, zero_states=not distinct)
            if not proof.agree:
                where = "" if at is None else f" at batch size {at}"
                raise Refused(f"differs{where} from every sLSTM variant (max rel err {proof.err:.1e})")
            agree = [v for v in agree if v in proof.agree]
        if not agree:
            raise Refused("agrees with different sLSTM variants at different batch sizes")
    variant = C.choose(agree, math.prod(layout.state.op_shape), distinct)
    if variant is None:
        raise Refused(f"the proof cannot tell {C.describe(agree[0])} from {C.describe(agree[1])} at this size")
    if variant[0] == C.NO_RULE:
        if variant[2]:
            raise Refused("no fresh rule and n clamped at 1: no variant of xaccel.slstm_step computes it")
        region = set(cell.region)
        if any(u not in region for r in "cnm" for u in cell.core.new[r].users):
            raise Refused("no fresh rule: its h equals xaccel.slstm_step's, but its c, n, m carry another "
                          "stabilizer and the graph reads them")
        variant = ("element", False, False)
    return variant, layout, ins, batch


def _emit(graph, cell: C.Cell, layout: C.Layout, ins, variant, order, batch=None) -> None:
    """The op right after its last input; the new states viewed back to the user's layout."""
    region = set(cell.region)
    inputs = [*cell.roots, *cell.inputs[:4]]
    last = max(inputs, key=order.__getitem__)
    outs = {r: cell.core.new[r] for r in "hcnm"}
    users = [u for o in outs.values() for u in o.users if u not in region]
    if any(order[u] <= order[last] for u in users):
        raise Refused("a result is read before all of the step's inputs exist")
    em = C.Emitter(graph, cell.core.L)
    state = layout.state
    with graph.inserting_before(last.next):
        like = cell.roots[0]
        B = C.emit_batch_size(em, batch, inputs)  # None where the batch size is static
        Wx = ins[0].emit(em, cell.roots, like, B)
        R, b = (p.emit(em, cell.roots, like) for p in ins[1:])
        olds = [state.emit(em, x, True, batch=B) for x in cell.inputs[:4]]
        op = em(torch.ops.xaccel.slstm_step.default, Wx, R, b, *olds, *variant)
        for j, r in enumerate("hcnm"):
            outside = {u for u in outs[r].users if u not in region}
            if outside:
                new = state.emit(em, em(operator.getitem, op, j), False, batch=B)
                outs[r].replace_all_uses_with(new, delete_user_cb=lambda u, o=outside: u in o)
