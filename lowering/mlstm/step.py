"""Pattern family "mlstm_step": one recurrent mLSTM step (decoding), rewritten to
torch.ops.xaccel.mlstm_step.

Matched, walking back from h = num / den (dtype casts `.to(...)` on the way are allowed: the op
computes in fp32 and returns h in q's dtype and fp32 states):

    logf = logsigmoid(f);  m' = max(logf + m, i)
    f' = exp(logf + m - m');  i' = exp(i - m')
    C' = f'[..., None] * C + i'[..., None] * (k[..., :, None] @ v[..., None, :])
    n' = f' * n + i' * k
    q_s = q * DQK**-0.5
    num = (q_s[..., None, :] @ C').squeeze(-2)
    den = max(|(q_s[..., None, :] @ n'[..., :, None]).squeeze(-2)|, exp(-m')) + eps
    h = num / den

This is the xlstm package's native step (gates and m shaped [B, NH, 1], q scaled, so the states
hold unscaled k: the op runs with scale_q=True). The four results h, C', n', m' may be used
anywhere; no other intermediate may be.
"""
from __future__ import annotations

import numbers
import operator

import torch
import torch.fx

from torch_xaccel.report import Fallback, GraphReport, Replacement

from .. import CONSTANT_FLOATS, PassContext
from ..graph_utils import location, val
from .matching import DynamicEps, NoMatch, expect, is_op

FAMILY = "mlstm_step"
aten = torch.ops.aten
REPORTED = "xaccel_replacement"  # meta key: the report entry of an inserted op, dropped if a larger region takes it
_CASTS = (aten.to.dtype, aten._to_copy.default)
_MAX = (aten.maximum.default, aten.max.other)


def _uncast(node, take):
    while is_op(node, *_CASTS):
        take(node)
        node = node.args[0]
    return node


def _squeezed(node, take):
    """x for x.squeeze(-2) / x.squeeze(2) of a 4-D tensor."""
    node = _uncast(node, take)
    expect(node, aten.squeeze.dim, what="squeeze(-2)")
    if node.args[1] % 4 != 2:
        raise NoMatch("squeeze of the wrong dim")
    take(node)
    return node.args[0]


def _unsq(node, dim, take):
    node = _uncast(node, take)
    expect(node, aten.unsqueeze.default, what=f"unsqueeze({dim})")
    if node.args[1] % (val(node).dim()) != dim % val(node).dim():
        raise NoMatch(f"unsqueeze at {node.args[1]}, expected {dim}")
    take(node)
    return node.args[0]


def _pair(node, targets, test, what):
    """(test(one arg), other arg) for a commutative binary node."""
    expect(node, *targets, what=what)
    for x, y in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        try:
            return test(x), y
        except NoMatch:
            continue
    raise NoMatch(f"{what}: neither argument fits")


def match(h: torch.fx.Node):
    seen: list = []
    take = seen.append
    div = expect(h, aten.div.Tensor, what="h = num / den")
    take(div)
    den = _uncast(div.args[1], take)
    add = expect(den, aten.add.Tensor, what="den + eps")
    take(add)
    mx, eps = (add.args[0], add.args[1]) if isinstance(add.args[0], torch.fx.Node) else (add.args[1], add.args[0])
    if not isinstance(eps, numbers.Number):
        raise DynamicEps()

    def abs_qn(x):
        a = expect(x, aten.abs.default, what="|q.n|")
        return a, _squeezed(a.args[0], lambda n: None)

    (a, qn_mm), e = _pair(mx, (aten.maximum.default,), abs_qn, "maximum(|q.n|, exp(-m'))")
    take(mx), take(a)
    _squeezed(a.args[0], take)
    e = take(expect(e, aten.exp.default, what="exp(-m')")) or e
    neg = expect(e.args[0], aten.neg.default, what="-m'")
    take(neg)
    m_new = neg.args[0]
    expect(qn_mm, aten.matmul.default, what="q_s @ n'")
    take(qn_mm)
    qs = _unsq(qn_mm.args[0], -2, take)
    n_new = _unsq(qn_mm.args[1], -1, take)
    num_mm = _squeezed(div.args[0], take)
    expect(num_mm, aten.matmul.default, what="q_s @ C'")
    take(num_mm)
    if _unsq(num_mm.args[0], -2, take) is not qs:
        raise NoMatch("numerator and denominator use different q")
    C_new = _uncast(num_mm.args[1], take)
    # q_s = q * DQK**-0.5
    expect(qs, aten.mul.Tensor, what="q * DQK**-0.5")
    take(qs)
    q, scale = (qs.args[0], qs.args[1]) if isinstance(qs.args[0], torch.fx.Node) else (qs.args[1], qs.args[0])
    dk = val(q).shape[-1]  # a literal scale against a symbolic head dim would hold at one size only
    if not isinstance(scale, numbers.Number) or not isinstance(dk, int) or abs(scale - dk ** -0.5) > 1e-6 * dk ** -0.5:
        raise NoMatch("q is not scaled by 1/sqrt(DQK) of a static head dim")
    # m' = max(logsigmoid(f) + m, i)
    expect(m_new, *_MAX, what="m' = max(logf + m, i)")
    take(m_new)

    def logf_plus_m(x):
        ad = expect(x, aten.add.Tensor, what="logf + m")
        for ls, m in ((ad.args[0], ad.args[1]), (ad.args[1], ad.args[0])):
            if is_op(ls, aten.log_sigmoid.default):
                return ad, ls, m
        raise NoMatch("no logsigmoid(f) + m")

    (a1, ls, m_old), i = _pair(m_new, _MAX, logf_plus_m, "max(logf + m, i)")
    take(a1), take(ls)

    def gate(x, first):
        ex = expect(x, aten.exp.default, what="exp gate")
        sub = expect(ex.args[0], aten.sub.Tensor, what="gate - m'")
        if sub.args[1] is not m_new:
            raise NoMatch("gate not stabilized by m'")
        return ex, sub

    # n' = f' * n + i' * k
    expect(n_new, aten.add.Tensor, what="n' = f' n + i' k")
    take(n_new)
    terms = [expect(t, aten.mul.Tensor, what="gate * vector") for t in n_new.args[:2]]
    f_act = i_act = n_old = k = None
    for t in terms:
        take(t)
        for g, x in ((t.args[0], t.args[1]), (t.args[1], t.args[0])):
            if not is_op(g, aten.exp.default):
                continue
            ex, sub = gate(g, True)
            lhs = sub.args[0]
            if lhs is i:
                i_act, k = ex, x
            elif is_op(lhs, aten.add.Tensor) and {id(a) for a in lhs.args[:2]} == {id(ls), id(m_old)}:
                f_act, n_old = ex, x
                take(lhs)
            else:
                continue
            take(ex), take(sub)
            break
    if f_act is None or i_act is None:
        raise NoMatch("n' is not f' * n + i' * k")
    n_old = _uncast(n_old, take)
    # C' = f'[..., None] * C + i'[..., None] * (k[..., :, None] @ v[..., None, :])
    expect(C_new, aten.add.Tensor, what="C' = f' C + i' k v^T")
    take(C_new)
    C_old = v = None
    for t in C_new.args[:2]:
        expect(t, aten.mul.Tensor, what="gate * matrix")
        take(t)
        for g, x in ((t.args[0], t.args[1]), (t.args[1], t.args[0])):
            if is_op(g, aten.unsqueeze.default) and g.args[0] is f_act:
                take(g)
                C_old = _uncast(x, take)
                break
            if is_op(g, aten.unsqueeze.default) and g.args[0] is i_act:
                take(g)
                outer = expect(x, aten.matmul.default, what="k v^T")
                take(outer)
                if _unsq(outer.args[0], -1, take) is not k:
                    raise NoMatch("C' and n' use different k")
                v = _unsq(outer.args[1], -2, take)
                break
    if C_old is None or v is None:
        raise NoMatch("C' is not f' C + i' k v^T")
    m_old = _uncast(m_old, take)
    return dict(q=q, k=k, v=v, i=i, f=ls.args[0], C=C_old, n=n_old, m=m_old), float(eps), seen, \
        dict(h=div, C=C_new, n=n_new, m=m_new)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    report = ctx.report
    graph = gm.graph
    gone: set = set()
    placed: dict = {}  # xaccel.mlstm_step node -> its report entry
    for h in [n for n in graph.nodes if is_op(n, aten.div.Tensor)]:
        if h in gone:
            continue
        try:
            ins, eps, nodes, outs = match(h)
        except NoMatch as e:
            if isinstance(e, DynamicEps):
                ctx.requests.add(CONSTANT_FLOATS)
            continue  # a division is not evidence of a step; the mlstm pass reports mLSTM-like code
        region = set(nodes) - set(ins.values())
        # a same-dtype .to() returns its input, so the trace may route later uses of a result
        # through a cast node inside the region: such casts stand for that result
        for n in list(region):
            if is_op(n, *_CASTS):
                src = _uncast(n, lambda x: None)
                for name, o in list(outs.items()):
                    if src is o and val(n).dtype == val(o).dtype:
                        outs[f"{name}@{n.name}"] = n
        # likewise a same-dtype cast of an input is that input: code that writes the new state back
        # into the old one (xLSTMLarge's inference: state.copy_(new)) reaches it through the cast
        for n in list(region):
            if is_op(n, *_CASTS) and n.args[0] in ins.values() and val(n).dtype == val(n.args[0]).dtype:
                n.replace_all_uses_with(n.args[0], delete_user_cb=lambda u: u not in region)
        # a value of the inputs alone (logsigmoid(f), shared by steps that read one f) stays for its
        # other readers; anything later in the step may not leave it
        escaped = [n.name for n in region if n not in outs.values() and any(u not in region for u in n.users)
                   and not all(a in ins.values() for a in n.all_input_nodes)]
        shapes_ok = all(isinstance(val(t), torch.Tensor) for t in ins.values()) and val(ins["q"]).dim() == 3
        if escaped or not shapes_ok:
            why = f"intermediates used elsewhere: {', '.join(escaped[:3])}" if escaped else "unexpected ranks"
            report.fallbacks.append(Fallback(FAMILY, f"recurrent mLSTM step not replaced: {why}", location(h)))
            continue
        q_dtype = val(ins["q"]).dtype
        state_dtype = torch.float64 if q_dtype == torch.float64 else torch.float32
        h_users_cast = all(is_op(u, *_CASTS) for u in outs["h"].users if u not in region)
        if (val(outs["h"]).dtype != q_dtype and not h_users_cast) or val(outs["C"]).dtype != state_dtype \
                or val(outs["n"]).dtype != state_dtype or val(outs["m"]).dtype != state_dtype:
            report.fallbacks.append(Fallback(FAMILY, "recurrent mLSTM step not replaced: result dtypes differ from the "
                                                     "op's (h in q's dtype, fp32 states)", location(h)))
            continue
        gate_rank = val(ins["i"]).dim()
        order = {n: i for i, n in enumerate(graph.nodes)}
        anchor = max(ins.values(), key=order.__getitem__)  # the op goes right after its last input
        outside = [u for o in outs.values() for u in o.users if u not in region]
        if any(order[u] <= order[anchor] for u in outside):
            report.fallbacks.append(Fallback(FAMILY, "recurrent mLSTM step not replaced: a result is read before "
                                                     "all of the step's inputs exist", location(h)))
            continue
        with graph.inserting_before(anchor.next):  # keeps the new nodes in creation order
            args = []
            for name in ("q", "k", "v", "i", "f", "C", "n", "m"):
                x = ins[name]
                if name in ("i", "f", "m") and gate_rank == 3:  # [B, NH, 1] -> [B, NH]
                    src = x
                    x = graph.call_function(aten.squeeze.dim, (src, -1))
                    x.meta["val"] = val(src).squeeze(-1)
                args.append(x)
            fused = graph.call_function(torch.ops.xaccel.mlstm_step.default, (*args, eps, True))
            got = {name: graph.call_function(operator.getitem, (fused, k))
                   for k, name in enumerate(("h", "C", "n", "m"))}
            if gate_rank == 3:
                got["m"] = graph.call_function(aten.unsqueeze.default, (got["m"], -1))
        fake_mode = getattr(val(ins["q"]), "fake_mode", None)
        if fake_mode is not None:
            with fake_mode:
                fake_args = [val(a) for a in args]
                fakes = torch.ops.xaccel.mlstm_step.default(*fake_args, eps, True)
            fused.meta["val"] = fakes
            for k, name in enumerate(("h", "C", "n", "m")):
                got[name].meta["val"] = fakes[k] if not (name == "m" and gate_rank == 3) else fakes[k].unsqueeze(-1)
            if gate_rank == 3:  # the getitem under the unsqueeze: later passes read its value too
                got["m"].args[0].meta["val"] = fakes[3]
        for name, node in outs.items():
            node.replace_all_uses_with(got[name.split("@")[0]], delete_user_cb=lambda u: u not in region)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for n in sorted(region, key=order.__getitem__, reverse=True):
            if not n.users:
                graph.erase_node(n)
                gone.add(n)
        report.replacements.append(Replacement(FAMILY, "xaccel.mlstm_step", "recurrent step (xlstm native form)",
                                               location(h)))
        placed[fused] = fused.meta[REPORTED] = report.replacements[-1]
    folded = fuse_step_loops(gm, report)
    drop = {id(placed[s]) for s in folded if s in placed}  # reported as part of a sequence launch instead
    report.replacements[:] = [r for r in report.replacements if id(r) not in drop]


# ---- a loop of steps over a sequence -> one chunkwise launch ------------------------------------

def _strip_gate_views(node):
    """select(I, 2, t) under the unsqueeze(-1)/squeeze(-1) pairs that [B, NH, 1] gates add."""
    while is_op(node, aten.squeeze.dim, aten.unsqueeze.default):
        node = node.args[0]
    return node


def _timestep(node):
    """(source [B, NH, S, ...] tensor, t) when node is source[:, :, t], else None."""
    node = _strip_gate_views(node)
    if is_op(node, aten.select.int) and node.args[1] % val(node.args[0]).dim() == 2:
        return node.args[0], node.args[2]
    return None


def _item(step, k):
    """The getitem(step, k) node, or None."""
    return next((u for u in step.users if u.target is operator.getitem and u.args[1] == k), None)


def _follows(prev, step) -> bool:
    """step's state inputs are exactly prev's state outputs."""
    C, n, m = step.args[5], step.args[6], _strip_gate_views(step.args[7])
    return (C is _item(prev, 1) and n is _item(prev, 2) and m is _item(prev, 3)
            and len(C.users) == 1 and len(n.users) == 1)


def _erase_dead_views(graph, nodes) -> None:
    """Erase the slicing/view nodes that fed removed steps, now without users."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if isinstance(n, torch.fx.Node) and not n.users and is_op(n, aten.select.int, aten.squeeze.dim,
                                                               aten.unsqueeze.default, aten.slice.Tensor):
            todo.extend(n.all_input_nodes)
            graph.erase_node(n)


def fuse_step_loops(gm: torch.fx.GraphModule, report: GraphReport) -> set:
    """Chains of xaccel.mlstm_step whose per-step inputs are consecutive time slices of the same
    tensors become one xaccel.mlstm with the chain's initial state; each step's h becomes a slice
    of the sequence output. The states convert between the step's scale_q convention and the
    sequence op's (a factor sqrt(DQK)), once per sequence."""
    graph = gm.graph
    steps = [n for n in graph.nodes if n.target is torch.ops.xaccel.mlstm_step.default]
    chains, used, folded = [], set(), set()
    for s in steps:
        if s in used:
            continue
        chain = [s]
        while True:
            nxt = [u for u in steps if u not in used and u not in chain and _follows(chain[-1], u)]
            if len(nxt) != 1:
                break
            chain.append(nxt[0])
        used.update(chain)
        if len(chain) >= 2:
            chains.append(chain)
    for chain in chains:
        srcs = []
        for j, st in enumerate(chain):
            ts = [_timestep(a) for a in st.args[:5]]
            if any(t is None for t in ts):
                break
            srcs.append(ts)
        if len(srcs) != len(chain):
            continue
        tensors = [t[0] for t in srcs[0]]
        t0 = srcs[0][0][1]
        if any(not isinstance(x[1], int) for ts in srcs for x in ts) or any(
                [x[0] for x in ts] != tensors or any(x[1] != t0 + j for x in ts) for j, ts in enumerate(srcs)):
            continue
        if len({(st.args[8], st.args[9]) for st in chain}) != 1:
            continue
        h_users = [u for st in chain if _item(st, 0) is not None for u in _item(st, 0).users]
        if any(getattr(getattr(u.target, "_schema", None), "is_mutable", False) for u in h_users):
            continue  # each h_t would become a view of one sequence output: no in-place writes to them
        eps, scale_q = chain[0].args[8], chain[0].args[9]
        L, dk = len(chain), val(tensors[0]).shape[-1]
        if not isinstance(dk, int):  # the state conversion below bakes sqrt(DQK) in as a number
            continue
        first, last = chain[0], chain[-1]
        to_ours, to_theirs = (dk ** -0.5, dk ** 0.5) if scale_q else (1.0, 1.0)
        with graph.inserting_before(first):
            seq_in = [graph.call_function(aten.slice.Tensor, (t, 2, t0, t0 + L)) for t in tensors]
            C0 = graph.call_function(aten.mul.Tensor, (first.args[5], to_ours))
            n0 = graph.call_function(aten.mul.Tensor, (first.args[6], to_ours))
            fused = graph.call_function(torch.ops.xaccel.mlstm.default, (*seq_in, C0, n0, first.args[7], eps, 64))
            H = graph.call_function(operator.getitem, (fused, 0))
            outs = [graph.call_function(aten.mul.Tensor,
                                        (graph.call_function(operator.getitem, (fused, 1)), to_theirs)),
                    graph.call_function(aten.mul.Tensor,
                                        (graph.call_function(operator.getitem, (fused, 2)), to_theirs)),
                    graph.call_function(operator.getitem, (fused, 3))]
            hs = [graph.call_function(aten.select.int, (H, 2, j)) for j in range(L)]
        fake_mode = getattr(val(tensors[0]), "fake_mode", None)
        if fake_mode is not None:  # meta for later passes (a GEMM may read h)
            with fake_mode:
                for node in [*seq_in, C0, n0]:
                    node.meta["val"] = node.target(*[val(a) if isinstance(a, torch.fx.Node) else a for a in node.args])
                fakes = fused.target(*[val(a) if isinstance(a, torch.fx.Node) else a for a in fused.args])
                fused.meta["val"], H.meta["val"] = fakes, fakes[0]
                for j, hj in enumerate(hs):
                    hj.meta["val"] = fakes[0].select(2, j)
        for j, st in enumerate(chain):
            h_item = _item(st, 0)
            if h_item is not None:
                h_item.replace_all_uses_with(hs[j])
        for k, node in enumerate(outs):
            item = _item(last, k + 1)
            if item is not None:
                item.replace_all_uses_with(node)
        for st in reversed(chain):  # the old steps, their now-unused getitems and input views
            for u in list(st.users):
                if not u.users:
                    graph.erase_node(u)
            if not st.users:
                args = st.all_input_nodes
                graph.erase_node(st)
                _erase_dead_views(graph, args)
                folded.add(st)
        report.replacements.append(Replacement("mlstm", "xaccel.mlstm", f"loop of {L} recurrent steps -> one launch",
                                               location(first)))
    return folded
