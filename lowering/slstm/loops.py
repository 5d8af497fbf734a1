"""Hand-written sLSTM loops that Dynamo unrolled, collapsed into one xaccel::slstm.

A Python loop over time steps reaches the graph as T copies of the step (tens of ATen nodes
each; Dynamo's trace, and this pass, grow with T: the report notes the count). `find_chains`
finds the steps (core.find_core around each max), chains them (step k+1's old c, n, m are
step k's new ones; its gates are linear in step k's h) and checks that the copies are the same
computation node for node, differing only in time indices (select, slice, narrow or tuple index
advancing by one per step). Each read of the step is then one of:
- shared: the same tensor in every step (R, b, Wx when sliced inside the step, initial states);
- per step: a different tensor in every step (Wx[:, t] + b computed in the loop, a projection).
The first step's old states are the loop's initial states (zeros built in the graph: none), unless
a first step written apart computes them (prologue.py).

`collapse` measures the first step's layouts (measure.py), measures how each additive input
moves with time (probes of steps 1, 2, T/2 and T: a shared tensor must advance by one stride per
step), proves those steps against every variant (variants.py; the copies differ only in time
indices, which move a read affinely, so these steps stand for all), and rewrites: one xaccel.slstm
whose Wx is a view of the shared tensor (or a stack of the per-step ones) and whose outputs are
viewed back to the user's layout: every h_t the graph reads, a torch.stack of all of them, and
the final c, n, m. Per-step inputs computed inside the loop move ahead of it. A loop of one step
is no chain (step.py takes it); steps whose inputs depend on earlier outputs (decoding) are not
a sequence either: step.py replaces them one by one.

A symbolic batch size (batch.py) is the one symbolic size allowed, and only as the leading dim of
the step's inputs: the layouts are measured at its example value, must read every root batch row
by batch row (`batch.check_batch_layouts`), are proven at the example value and at one more, and
the op's views take the size from a root at run time.

A refused loop is reported once, its nodes marked (graph_utils.REPORTED_REGION) so that later
passes neither report nor analyse them again.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx import Node

from torch_xaccel.report import Fallback, Replacement

from ..graph_utils import location, mutated_nodes
from ..proof import NoMatch, Refused, accuracy
from . import batch as Bt, prologue, variants as V
from .cell import Cell, build_cell, escapes, extract, h_candidates, tensor_roots_refusal
from .core import find_core, seeds
from .emit import Emitter, erase_dead, mark_reported
from .measure import Layout, additive_tables, measure, running
from .nodes import TIME_ARGS, VIEWS, example_shape, is_op, is_zeros, val
from .plans import Plan, Stack, StateMap, Sum, Zeros, batch_invariant, earlier, plan_of, rebind, timed
from .prepare import prepare

FAMILY = "slstm"
aten = torch.ops.aten
LONG_LOOP = 64  # from this many steps on the report suggests avoiding the unrolled trace


@dataclass
class Chain:
    cells: list
    shared: list  # per root slot: the same tensor in every step
    why_not: str | None = None  # why it is not a sequence (decoding), or None
    first: prologue.Prologue | None = None  # a first step written apart before the cells, where found

    def nodes(self) -> list:
        """Every node of its steps."""
        return [n for c in self.cells for n in c.region] + (self.first.nodes if self.first else [])


def find_chains(graph: torch.fx.Graph) -> list:
    """Chains of >= 2 aligned steps, in graph order."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    cores = []
    for mx in seeds(graph):
        try:
            cores.append(find_core(mx))
        except NoMatch:
            pass
    chains = []
    for seq in _sequences(cores):
        for run in _aligned_runs(seq, order):
            if len(run) >= 2:
                chains.append(_classify(run, order))
    return chains


def claimed(graph: torch.fx.Graph) -> set:
    """The max nodes of steps that belong to a sequence this pass collapses (a first step written
    apart included)."""
    out = set()
    for ch in find_chains(graph):
        if ch.why_not is None:
            out |= {c.core.max for c in ch.cells} | set(ch.first.seeds() if ch.first else ())
    return out


def _sequences(cores) -> list:
    """Cores linked new state -> old state, as maximal sequences."""
    by_c = {}
    for k in cores:
        by_c.setdefault(k.new["c"], []).append(k)
    succ = {}
    for k in cores:
        preds = [p for p in by_c.get(k.old["c"], ()) if k.old["n"] is p.new["n"] and k.old["m"] is p.new["m"]]
        if len(preds) == 1:
            succ.setdefault(preds[0], []).append(k)
    succ = {p: ks[0] for p, ks in succ.items() if len(ks) == 1}
    has_pred = set(succ.values())
    out = []
    for k in cores:
        if k in has_pred:
            continue
        seq = [k]
        while seq[-1] in succ:
            seq.append(succ[seq[-1]])
        out.append(seq)
    return out


def _aligned_runs(seq, order) -> list:
    """The sequence's cells split where consecutive steps are not the same computation."""
    cells = []
    for k in range(1, len(seq)):
        try:
            cells.append(build_cell(seq[k], seq[k - 1].new["h"], order))
        except NoMatch:
            cells.append(None)
    first = None
    if cells and cells[0] is not None:
        for h in h_candidates(seq[0], order):
            try:
                c0 = build_cell(seq[0], h, order)
            except NoMatch:
                continue
            if _align(c0, cells[0]) is not None:
                first = c0
                break
    runs, cur, keys = [], [], None
    for c in [first, *cells]:
        if c is None:
            runs.append(cur)
            cur, keys = [], None
            continue
        if cur:
            d = _align(cur[-1], c)
            if d is None or any(v != 1 for v in d.values()) or (keys is not None and set(d) != keys):
                runs.append(cur)
                cur, keys = [c], None
                continue
            keys = set(d)
        cur.append(c)
    runs.append(cur)
    return runs


def _align(a: Cell, b: Cell) -> dict | None:
    """{(node index, argument position): b's int - a's int} where the two steps differ only in
    time indices; None where they differ otherwise."""
    if len(a.region) != len(b.region) or len(a.inputs) != len(b.inputs):
        return None
    ia = {n: k for k, n in enumerate(a.region)}
    ib = {n: k for k, n in enumerate(b.region)}
    slots_a = {}
    for j, x in enumerate(a.inputs):
        slots_a.setdefault(x, set()).add(j)
    slots_b = {}
    for j, x in enumerate(b.inputs):
        slots_b.setdefault(x, set()).add(j)
    diffs = {}
    for k, (x, y) in enumerate(zip(a.region, b.region)):
        if x.op != y.op or x.target != y.target or example_shape(x) != example_shape(y):
            return None
        fa, sa = pytree.tree_flatten((x.args, x.kwargs))
        fb, sb = pytree.tree_flatten((y.args, y.kwargs))
        if sa != sb:
            return None
        for p, (u, v) in enumerate(zip(fa, fb)):
            if isinstance(v, Node) or isinstance(u, Node):
                if not (isinstance(u, Node) and isinstance(v, Node)):
                    return None
                if v in ib:
                    ok = ia.get(u) == ib[v]
                else:
                    ok = u is v or bool(slots_a.get(u, set()) & slots_b.get(v, set()))
                if not ok:
                    return None
            elif u != v:
                if not (type(u) is int and type(v) is int and p in TIME_ARGS.get(x.target, ())):
                    return None
                diffs[(k, p)] = v - u
    return diffs


def _classify(cells, order) -> Chain:
    """Shared and per-step roots; why the chain is not a sequence, if it is not: inputs that
    depend on earlier outputs (decoding), or R recomputed differently at each step. A first step
    written apart, where one computes the first old states."""
    slots = len(cells[0].roots)
    shared = [all(c.roots[j] is cells[0].roots[j] for c in cells) for j in range(slots)]
    chain = Chain(cells, shared)
    inside = {n for c in cells for n in c.region}
    lo = order[cells[0].region[0]]
    per_step = [c.roots[j] for c in cells for j in range(slots) if not shared[j]]
    if _reaches(per_step, inside, lo, order):
        chain.why_not = "each step's input depends on an earlier step's output (decoding): left to slstm_step"
    else:
        chain.first = prologue.find(cells, shared, order)
    return chain


def _reaches(nodes, targets: set, lo: int, order) -> bool:
    """Whether any of `nodes` depends on a node in `targets` (looking back to graph position lo)."""
    seen, todo = set(), list(nodes)
    while todo:
        x = todo.pop()
        if x in seen or order[x] < lo:
            continue
        if x in targets:
            return True
        seen.add(x)
        todo.extend(x.all_input_nodes)
    return False


# ---- the rewrite ------------------------------------------------------------------------------------

def collapse(gm: torch.fx.GraphModule, ctx) -> None:
    graph = gm.graph
    if not prepare(graph):
        return
    tried = set()
    while True:  # one chain at a time: a rewrite changes the nodes a later chain reads
        todo = [ch for ch in find_chains(graph) if ch.cells[0].core.max not in tried]
        if not todo:
            return
        chain = todo[0]
        tried.add(chain.cells[0].core.max)
        where = location(chain.cells[0].core.max)
        if chain.why_not:
            continue
        try:
            _collapse(gm, ctx, chain, where)
        except Refused as e:
            mark_reported(chain.nodes())
            ctx.report.fallbacks.append(Fallback(FAMILY, f"sLSTM-shaped loop at {where}: {e}", where))


@dataclass
class _Inputs:
    roots: list  # the op's root tensors (nodes): shared ones, then each step's own
    slot: dict  # (step, root slot) -> index in roots; step -1: a first step written apart
    Wx: Plan  # [B, T, 4, NH, D]
    R: Plan  # [NH, 4, D, D]
    b: Plan  # [4, NH, D]
    t0: int = 0  # the op's time index of the chain's first step (1 after a first step written apart)


def _check(graph, chain) -> None:
    """Refuse what the op cannot take: dtypes, values read or written elsewhere."""
    cells = chain.cells
    T = len(cells)
    odd = next((why for c in cells if (why := tensor_roots_refusal(c))), None)
    if odd:
        raise Refused(odd)
    dtype = val(cells[0].core.new["h"]).dtype
    if dtype not in (torch.float32, torch.float64) or any(not _computes_in(c, dtype) for c in cells):
        raise Refused(f"the step computes in {dtype} or mixes dtypes (the op's state math is fp32 or fp64)")
    for k, c in enumerate(cells):
        nxt = set(cells[k + 1].region) if k + 1 < T else set()
        esc = escapes(c, nxt)
        if esc:
            raise Refused(f"step {k + 1}'s intermediate {esc[0].name} is read outside the step")
        if k + 1 < T:
            for r in "cnm":
                if any(u not in nxt and u not in set(c.region) for u in c.core.new[r].users):
                    raise Refused(f"the loop reads {r} after step {k + 1}; xaccel.slstm returns the last state only")
    written = mutated_nodes(graph)
    if any(n in written for c in cells for n in (*c.region, *c.inputs)):
        raise Refused("a value of the loop is written in place")


def _computes_in(cell: Cell, dtype) -> bool:
    """Every value the step computes is in `dtype`; its roots may be narrower floats (bf16 or fp16
    projections cast up inside the step: the op's plans read them cast, exactly as written)."""
    computed = [*cell.core.new.values(), *(n for n in cell.pre if not is_op(n, *VIEWS))]
    narrower = (torch.float16, torch.bfloat16) if dtype == torch.float32 else (torch.float16, torch.bfloat16,
                                                                               torch.float32)
    return (all(val(n).dtype == dtype for n in computed if isinstance(val(n), torch.Tensor))
            and all(val(r).dtype in (dtype, *narrower) for r in cell.roots))


def _time_tables(chain, layout, probed) -> dict:
    """Additive tables of the probed steps: {step: {slot: (rid, idx)}}."""
    return {k: additive_tables(chain.cells[k], layout) for k in probed}


def _inputs(chain, layout, tables, probed, first: prologue.Prologue | None = None) -> _Inputs:
    """Plans for the op's Wx, R, b over the chain's roots (and a first step's, where given)."""
    roots, slot = _root_slots(chain, layout, first)
    Wx, b = _additive_plans(chain, layout, tables, probed, roots, slot, first)
    return _Inputs(roots, slot, Wx, rebind(layout.R, lambda j: slot[(0, j)]), b, int(first is not None))


def _root_slots(chain, layout, first) -> tuple:
    """(the op's root tensors, (step, slot) -> index): shared roots once, per-step ones for every
    step; a recurrent weight computed in each step counts once, if each step computes it alike."""
    cells, T, shared = chain.cells, len(chain.cells), chain.shared
    roots, slot = [], {}
    for j in range(len(shared)):
        if shared[j]:
            slot.update({(k, j): len(roots) for k in range(T)})
            roots.append(cells[0].roots[j])
        elif j in layout.recurrent:
            first_root = cells[0].roots[j]
            if any(c.roots[j].target != first_root.target or c.roots[j].args != first_root.args for c in cells):
                raise Refused("R is computed anew at each step")
            slot.update({(k, j): len(roots) for k in range(T)})
            roots.append(first_root)
        else:
            for k, c in enumerate(cells):
                slot[(k, j)] = len(roots)
                roots.append(c.roots[j])
            if first is not None:
                slot[(-1, j)] = len(roots)
                roots.append(first.counterparts[j])
    return roots, slot


def _additive_plans(chain, layout, tables, probed, roots, slot, first) -> tuple:
    """(Wx [B, T, 4, NH, D], b [4, NH, D]): a shared input that moves with time is one view over
    time (its stride per step measured); one that does not and is the same for every batch row is
    the bias; per-step inputs are stacked over time. A first step written apart reads the entries
    one stride before the chain's first, or its own counterpart of a per-step input."""
    cells, shared = chain.cells, chain.shared
    steps = list(range(-1 if first else 0, len(cells)))
    shapes = {g: example_shape(r) for g, r in enumerate(roots)}
    moving, biases, parts, stride = [], [], [], {}
    for j, (rid0, idx0) in tables[0].items():
        if not shared[j]:
            if any(not torch.equal(tables[k][j][1], idx0) for k in probed):
                raise Refused("a per-step input enters the gates differently at different steps")
            p = plan_of([(torch.where(rid0 >= 0, 0, -1), idx0)], {0: example_shape(cells[0].roots[j])}, [1, 2])
            if p is None:
                raise Refused("a per-step input's layout is not a view")
            parts.append(Stack(1, [rebind(p, lambda _, k=k: slot[(k, j)]) for k in steps]))
            continue
        g = slot[(0, j)]
        stride[g] = _time_stride(tables, j, probed)
        table = (torch.where(rid0 >= 0, g, -1), idx0)
        if stride[g] == 0 and batch_invariant(table):
            biases.append((table[0][0], table[1][0]))
        else:
            moving.append(table)
    if moving:
        p = plan_of(moving, shapes, [1, 2])
        if p is None:
            raise Refused("Wx's layout is not a view of the input")
        if first is not None and (p := earlier(p, stride)) is None:
            raise Refused("its input would start before the input tensor's first entry")
        parts.insert(0, timed(p, 1, len(steps), stride))
    if not parts:
        raise Refused("no input term Wx_t in the gates")
    state = layout.state
    b = plan_of(biases, shapes, [0, 1]) if biases else Zeros((4, state.NH, state.D))
    if b is None:
        raise Refused("the bias's layout is not a view")
    return (parts[0] if len(parts) == 1 else Sum(parts)), b


def _time_stride(tables, j, probed) -> int:
    """How far shared root j's entries move per step (0: not at all): steps 1 and 2 give it; it
    must be one constant, forward, and hold at every probed step."""
    rid0, idx0 = tables[0][j]
    used = rid0 >= 0
    moves = (tables[1][j][1] - idx0)[used]
    sigma = int(moves[0]) if moves.numel() else 0
    if not bool((moves == sigma).all()) or sigma < 0:
        raise Refused("an input is not read at one position per step, advancing with the step")
    for k in probed:
        rid, idx = tables[k][j]
        if not torch.equal(rid, rid0) or not torch.equal(idx[used], idx0[used] + k * sigma):
            raise Refused(f"step {k + 1} reads its input elsewhere than its time index implies")
    return sigma


def _root_values(ins: _Inputs, layout: Layout, gen, dtype, batch, at) -> list:
    """Random values for the op's roots, recurrent weights scaled by 1/sqrt(D)."""
    rec = {ins.slot[(0, j)] for j in layout.recurrent}
    vals = [torch.randn(Bt.shape_at(r, batch, at), generator=gen, dtype=dtype) for r in ins.roots]
    return [v / layout.state.D ** 0.5 if g in rec else v for g, v in enumerate(vals)]


def _op_inputs(ins: _Inputs, vals: list, t: int, at) -> list:
    """Wx_t (the op's time index t), R, b from the root values."""
    like = vals[0]
    return [ins.Wx.run(vals, like, at)[:, t], ins.R.run(vals, like), ins.b.run(vals, like)]


def _prove(chain, layout, ins: _Inputs, probed, batch: Bt.BatchSize | None = None) -> tuple:
    """The hypothesis every probed step agrees with, or Refused naming the step that does not. With
    a symbolic batch size, at its example value and at another."""
    agree, evidence = V.hypotheses(chain.cells[0].core), False
    dtype = val(chain.cells[0].core.new["h"]).dtype
    base = 2 if chain.first else 1  # the loop's number of the chain's first step
    for at in Bt.proof_batches(batch):
        state = Bt.state_at(layout.state, at)
        for k in probed:
            c = chain.cells[k]
            olds = c.inputs[:4]
            distinct = len({id(x) for x in olds}) == 4
            if not distinct and not all(is_zeros(x) for x in olds):
                raise Refused(f"step {k + base}'s states are one tensor")
            outs = [c.core.new[r] for r in "hcnm"]
            fns = [extract(c.region, c.inputs, outs, dtype=d, batch=at) for d in (None, torch.float64)]

            def make_inputs(gen, k=k, c=c, at=at):
                vals = _root_values(ins, layout, gen, dtype, batch, at)
                mine = [vals[ins.slot[(k, j)]] for j in range(len(c.roots))]
                consts = [torch.randn(Bt.shape_at(x, batch, at), generator=gen).to(val(x).dtype) for x in c.consts]
                return [*mine, *consts], lambda cast: _op_inputs(ins, cast(vals), ins.t0 + k, at)

            proof = V.prove(fns, state, dtype, make_inputs, agree, zero_states=not distinct)
            if not proof.agree:
                raise Refused(proof.differs(f"step {k + base}" + ("" if at is None else f" at batch size {at}")))
            agree = proof.agree
            evidence = evidence or distinct
    return V.choose(agree, math.prod(layout.state.op_shape), evidence)


def _op_variant(variant) -> tuple:
    """The op's variant for code without a fresh rule after a fresh first step: from there no row is
    fresh again (n >= 1), so every rule and clamp of the op computes what the code does."""
    return ("element", False, variant[2]) if variant[0] == V.NO_RULE else variant


def _accept_no_rule(chain, variant) -> tuple:
    """Code without a fresh rule (variants.py's docstring): the op's element rule where only h is
    read."""
    if variant[0] != V.NO_RULE:
        return variant, ""
    if variant[2]:
        raise Refused("no fresh rule and n clamped at 1: the clamp acts on a stabilizer that starts at "
                      "max(i, logsigmoid(f) + m0) instead of i, which no variant of xaccel.slstm computes")
    last = chain.cells[-1]
    if any(u not in set(last.region) for r in "cnm" for u in last.core.new[r].users):
        raise Refused("no fresh rule: its h equals xaccel.slstm's, but its c, n, m carry another stabilizer "
                      "(the same state scaled by exp(m)) and the graph reads them")
    return ("element", False, False), " (code without a fresh rule: the same h; its c, n, m are not read)"


def _first_step(graph, chain, layout, tables, probed, variant, batch) -> tuple:
    """(the op's inputs from the first step written apart on, None) where it is the op's first
    step from no state; else (None, why not)."""
    first = chain.first
    dtype = val(chain.cells[0].core.new["h"]).dtype
    if any(n in mutated_nodes(graph) for n in (*first.nodes, *first.inputs)):
        return None, "a value of it is written in place"
    if any(val(x).dtype != dtype for x in (*first.states, *first.counterparts.values())):
        return None, "it computes in another dtype"
    try:
        ins = _inputs(chain, layout, tables, probed, first)
        if batch is not None:
            Bt.check_batch_layouts(chain.cells[0].core.new["h"], layout.state, ins.Wx, ins.R, ins.b, ins.roots, batch)
        _prove_first(first, layout, ins, _op_variant(variant), dtype, batch)
    except Refused as e:
        return None, str(e)
    return ins, None


def _prove_first(first, layout, ins: _Inputs, variant, dtype, batch) -> None:
    """The first step's h, c, n, m against reference.step from zero states on the entries the op
    reads at time 0, in the step's dtype and in float64 (lowering/proof.py's accuracy)."""
    index = {x: g for g, x in enumerate(ins.roots)}
    step = V.step_of(variant)
    gen = torch.Generator().manual_seed(1)
    for at in Bt.proof_batches(batch):
        state = Bt.state_at(layout.state, at)
        fns = [extract(first.nodes, first.inputs, first.states, dtype=d, batch=at) for d in (None, torch.float64)]
        for _ in range(V.DRAWS):
            vals = _root_values(ins, layout, gen, dtype, batch, at)
            args = [vals[index[x]] if x in index else
                    torch.randn(Bt.shape_at(x, batch, at), generator=gen).to(val(x).dtype) for x in first.inputs]
            zeros = [torch.zeros(state.op_shape, dtype=dtype)] * 4
            low = [state.run(o, to_op=True) for o in fns[0](*args)]
            high = [state.run(o, to_op=True) for o in fns[1](*V.exact(args))]
            ops = step(*_op_inputs(ins, V.exact(vals), 0, at), *V.exact(zeros)), \
                step(*_op_inputs(ins, vals, 0, at), *zeros)
            for acc in map(accuracy, high, low, *ops):
                if not acc.holds():
                    raise Refused(f"it is not the op's first step from no state ({acc})")


def _collapse(gm, ctx, chain: Chain, where: str) -> None:
    graph = gm.graph
    cells = chain.cells
    T = len(cells)
    _check(graph, chain)
    batch = Bt.batch_size(chain.cells)
    probed = sorted({0, 1, T // 2, T - 1})
    why_first = None
    with running("the loop's steps"):
        layout = measure(cells[0])
        tables = _time_tables(chain, layout, probed)
        ins = _inputs(chain, layout, tables, probed)
        if batch is not None:
            Bt.check_batch_layouts(cells[0].core.new["h"], layout.state, ins.Wx, ins.R, ins.b, ins.roots, batch)
        variant = _prove(chain, layout, ins, probed, batch)
        with_first = None
        if chain.first is not None:
            with_first, why_first = _first_step(graph, chain, layout, tables, probed, variant, batch)
    if with_first is not None:
        ins, variant, note = with_first, _op_variant(variant), ", its first step written apart"
    else:  # from a fresh first step no row is fresh again: an n clamp's tie gradient matters only here
        if tie := V.tie_refusal(cells[0].core, cells[0].core.old["n"], ctx.training):
            raise Refused(tie)
        variant, note = _accept_no_rule(chain, variant)
        if why_first:
            note += f"; its first step, written apart, stays as written: {why_first}"
    first = chain.first if with_first is not None else None
    order = {n: i for i, n in enumerate(graph.nodes)}
    start = min((n for n in cells[0].region), key=order.__getitem__)
    last = max((n for n in cells[-1].region), key=order.__getitem__)
    span = order[last] - order[start] + 1
    olds = [] if first else cells[0].inputs[:4]
    regions = ([first.nodes] if first else []) + [c.region for c in cells]
    hs = ([first.states[0]] if first else []) + [c.core.new["h"] for c in cells]
    anchor = min([start, *(u for u in hs[0].users if u not in set(regions[0]) | set(regions[1]))],
                 key=order.__getitem__)
    anchor = _hoist(graph, [*ins.roots, *olds], anchor, order, {n for r in regions for n in r})
    _emit(graph, chain, layout, ins, variant, olds, anchor, batch, regions, hs)
    erase_dead(graph, [n for r in regions for n in r] + list(olds))
    trace = f"the unrolled loop had {span} ATen nodes ({span // T} per step); Dynamo's trace grows with T"
    if T >= LONG_LOOP:
        trace += (": for long sequences call a library sLSTM that traces as one call (FlashRNN, xlstm) or "
                  "torch.ops.xaccel.slstm, or trace with a short T")
    ctx.report.replacements.append(Replacement(
        FAMILY, "xaccel.slstm", f"unrolled sLSTM loop, {len(hs)} steps, variant {V.describe(variant)}{note}"
        + Bt.describe_batch(batch),
        where,
        note=trace))


def _hoist(graph, inputs, anchor, order, inside: set) -> Node:
    """Move the op's inputs computed inside the loop (a per-step Wx_t + b) and what they need
    from there to before the loop's first node; returns where the op goes."""
    need, todo = set(), [n for n in inputs if order[n] > order[anchor]]
    while todo:
        x = todo.pop()
        if x in need or order[x] <= order[anchor]:
            continue
        need.add(x)
        todo.extend(x.all_input_nodes)
    if any(x in inside or x.op != "call_function" or x.is_impure() for x in need):
        raise Refused("the loop's inputs are computed together with its outputs")
    written = mutated_nodes(graph) if need else set()
    if any(x in written or any(a in written for a in x.all_input_nodes) for x in need):
        raise Refused("the loop's inputs read values written in place")
    for x in sorted(need, key=order.__getitem__):
        anchor.prepend(x)
    return anchor


def _stacks(hs) -> list:
    """torch.stack nodes of every step's h, in step order."""
    return [u for u in hs[0].users if is_op(u, aten.stack.default) and list(u.args[0]) == hs]


def _emit(graph, chain, layout, ins: _Inputs, variant, olds, anchor, batch, regions, hs) -> None:
    """The op before `anchor`; each step's h the graph reads (regions[k]'s h is hs[k]), every
    torch.stack of them and the last step's c, n, m viewed back to the user's layout."""
    T = len(hs)
    state = layout.state
    em = Emitter(graph, chain.cells[0].core.max)
    dtype = val(hs[-1]).dtype
    with graph.inserting_before(anchor):
        # narrower roots cast up as the user's step casts them (_computes_in)
        roots = [r if val(r).dtype == dtype else em(aten._to_copy.default, r, dtype=dtype) for r in ins.roots]
        like = roots[0]
        B = Bt.emit_batch_size(em, batch, [*roots, *olds])  # None where the batch size is static
        Wx = ins.Wx.emit(em, roots, like, B)
        R, b = ins.R.emit(em, roots, like), ins.b.emit(em, roots, like)
        init = [None] * 4 if all(is_zeros(x) for x in olds) else [state.emit(em, x, True, batch=B) for x in olds]
        op = em(torch.ops.xaccel.slstm.default, Wx, R, b, *init, *variant)
        y = em(operator.getitem, op, 0)
        for s in _stacks(hs):
            s.replace_all_uses_with(_stacked(em, state, y, T, s.args[1] if len(s.args) > 1 else 0, B))
            graph.erase_node(s)
        for k, h in enumerate(hs):
            mine = set(regions[k]) | (set(regions[k + 1]) if k + 1 < T else set())
            outside = {u for u in h.users if u not in mine}
            if outside:
                h.replace_all_uses_with(state.emit(em, em(aten.select.int, y, 1, k), False, batch=B),
                                        delete_user_cb=lambda u, o=outside: u in o)
        last = chain.cells[-1]
        for j, r in enumerate("cnm"):
            node = last.core.new[r]
            outside = {u for u in node.users if u not in set(last.region)}
            if outside:
                node.replace_all_uses_with(state.emit(em, em(operator.getitem, op, 2 + j), False, batch=B),
                                           delete_user_cb=lambda u, o=outside: u in o)


def _stacked(em, state: StateMap, y, T: int, dim: int, batch=None):
    """torch.stack(every h, dim) in the user's layout, from y [B, T, NH, D]."""
    dim %= len(state.S) + 1
    if list(state.S) == list(state.op_shape):
        return y if dim == 1 else em(aten.movedim.int, y, 1, dim)
    seq = state.emit(em, em(aten.movedim.int, y, 1, 0), False, lead=[T], batch=batch)
    return em(aten.movedim.int, seq, 0, dim) if dim else seq
