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

from .graph_utils import location, val
from .mlstm import NoMatch, _example_int, _expect, _is

FAMILY = "mlstm_step"
aten = torch.ops.aten
_CASTS = (aten.to.dtype, aten._to_copy.default)
_MAX = (aten.maximum.default, aten.max.other)


def _uncast(node, take):
    while _is(node, *_CASTS):
        take(node)
        node = node.args[0]
    return node


def _squeezed(node, take):
    """x for x.squeeze(-2) / x.squeeze(2) of a 4-D tensor."""
    node = _uncast(node, take)
    _expect(node, aten.squeeze.dim, what="squeeze(-2)")
    if node.args[1] % 4 != 2:
        raise NoMatch("squeeze of the wrong dim")
    take(node)
    return node.args[0]


def _unsq(node, dim, take):
    node = _uncast(node, take)
    _expect(node, aten.unsqueeze.default, what=f"unsqueeze({dim})")
    if node.args[1] % (val(node).dim()) != dim % val(node).dim():
        raise NoMatch(f"unsqueeze at {node.args[1]}, expected {dim}")
    take(node)
    return node.args[0]


def _pair(node, targets, test, what):
    """(test(one arg), other arg) for a commutative binary node."""
    _expect(node, *targets, what=what)
    for x, y in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        try:
            return test(x), y
        except NoMatch:
            continue
    raise NoMatch(f"{what}: neither argument fits")


def match(h: torch.fx.Node):
    seen: list = []
    take = seen.append
    div = _expect(h, aten.div.Tensor, what="h = num / den")
    take(div)
    den = _uncast(div.args[1], take)
    add = _expect(den, aten.add.Tensor, what="den + eps")
    take(add)
    mx, eps = (add.args[0], add.args[1]) if isinstance(add.args[0], torch.fx.Node) else (add.args[1], add.args[0])
    if not isinstance(eps, numbers.Number):
        raise NoMatch("eps is not a constant")

    def abs_qn(x):
        a = _expect(x, aten.abs.default, what="|q.n|")
        return a, _squeezed(a.args[0], lambda n: None)

    (a, qn_mm), e = _pair(mx, (aten.maximum.default,), abs_qn, "maximum(|q.n|, exp(-m'))")
    take(mx), take(a)
    _squeezed(a.args[0], take)
    e = take(_expect(e, aten.exp.default, what="exp(-m')")) or e
    neg = _expect(e.args[0], aten.neg.default, what="-m'")
    take(neg)
    m_new = neg.args[0]
    _expect(qn_mm, aten.matmul.default, what="q_s @ n'")
    take(qn_mm)
    qs = _unsq(qn_mm.args[0], -2, take)
    n_new = _unsq(qn_mm.args[1], -1, take)
    num_mm = _squeezed(div.args[0], take)
    _expect(num_mm, aten.matmul.default, what="q_s @ C'")
    take(num_mm)
    if _unsq(num_mm.args[0], -2, take) is not qs:
        raise NoMatch("numerator and denominator use different q")
    C_new = _uncast(num_mm.args[1], take)
    # q_s = q * DQK**-0.5
    _expect(qs, aten.mul.Tensor, what="q * DQK**-0.5")
    take(qs)
    q, scale = (qs.args[0], qs.args[1]) if isinstance(qs.args[0], torch.fx.Node) else (qs.args[1], qs.args[0])
    dk = _example_int(val(q).shape[-1])
    if not isinstance(scale, numbers.Number) or dk is None or abs(scale - dk ** -0.5) > 1e-6 * dk ** -0.5:
        raise NoMatch("q is not scaled by 1/sqrt(DQK)")
    # m' = max(logsigmoid(f) + m, i)
    _expect(m_new, *_MAX, what="m' = max(logf + m, i)")
    take(m_new)

    def logf_plus_m(x):
        ad = _expect(x, aten.add.Tensor, what="logf + m")
        for ls, m in ((ad.args[0], ad.args[1]), (ad.args[1], ad.args[0])):
            if _is(ls, aten.log_sigmoid.default):
                return ad, ls, m
        raise NoMatch("no logsigmoid(f) + m")

    (a1, ls, m_old), i = _pair(m_new, _MAX, logf_plus_m, "max(logf + m, i)")
    take(a1), take(ls)

    def gate(x, first):
        ex = _expect(x, aten.exp.default, what="exp gate")
        sub = _expect(ex.args[0], aten.sub.Tensor, what="gate - m'")
        if sub.args[1] is not m_new:
            raise NoMatch("gate not stabilized by m'")
        return ex, sub

    # n' = f' * n + i' * k
    _expect(n_new, aten.add.Tensor, what="n' = f' n + i' k")
    take(n_new)
    terms = [_expect(t, aten.mul.Tensor, what="gate * vector") for t in n_new.args[:2]]
    f_act = i_act = n_old = k = None
    for t in terms:
        take(t)
        for g, x in ((t.args[0], t.args[1]), (t.args[1], t.args[0])):
            if not _is(g, aten.exp.default):
                continue
            ex, sub = gate(g, True)
            lhs = sub.args[0]
            if lhs is i:
                i_act, k = ex, x
            elif _is(lhs, aten.add.Tensor) and {id(a) for a in lhs.args[:2]} == {id(ls), id(m_old)}:
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
    _expect(C_new, aten.add.Tensor, what="C' = f' C + i' k v^T")
    take(C_new)
    C_old = v = None
    for t in C_new.args[:2]:
        _expect(t, aten.mul.Tensor, what="gate * matrix")
        take(t)
        for g, x in ((t.args[0], t.args[1]), (t.args[1], t.args[0])):
            if _is(g, aten.unsqueeze.default) and g.args[0] is f_act:
                take(g)
                C_old = _uncast(x, take)
                break
            if _is(g, aten.unsqueeze.default) and g.args[0] is i_act:
                take(g)
                outer = _expect(x, aten.matmul.default, what="k v^T")
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


def run(gm: torch.fx.GraphModule, report: GraphReport, training: bool) -> None:
    graph = gm.graph
    gone: set = set()
    for h in [n for n in graph.nodes if _is(n, aten.div.Tensor)]:
        if h in gone:
            continue
        try:
            ins, eps, nodes, outs = match(h)
        except NoMatch:
            continue  # a division is not evidence of a step; the mlstm pass reports mLSTM-like code
        region = set(nodes) - set(ins.values())
        # a same-dtype .to() returns its input, so the trace may route later uses of a result
        # through a cast node inside the region: such casts stand for that result
        for n in list(region):
            if _is(n, *_CASTS):
                src = _uncast(n, lambda x: None)
                for name, o in list(outs.items()):
                    if src is o and val(n).dtype == val(o).dtype:
                        outs[f"{name}@{n.name}"] = n
        escaped = [n.name for n in region if n not in outs.values() and any(u not in region for u in n.users)]
        shapes_ok = all(isinstance(val(t), torch.Tensor) for t in ins.values()) and val(ins["q"]).dim() == 3
        if escaped or not shapes_ok:
            why = f"intermediates used elsewhere: {', '.join(escaped[:3])}" if escaped else "unexpected ranks"
            report.fallbacks.append(Fallback(FAMILY, f"recurrent mLSTM step not replaced: {why}", location(h)))
            continue
        q_dtype = val(ins["q"]).dtype
        state_dtype = torch.float64 if q_dtype == torch.float64 else torch.float32
        h_users_cast = all(_is(u, *_CASTS) for u in outs["h"].users if u not in region)
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
            got = {name: graph.call_function(operator.getitem, (fused, k)) for k, name in enumerate(("h", "C", "n", "m"))}
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
        for name, node in outs.items():
            node.replace_all_uses_with(got[name.split("@")[0]], delete_user_cb=lambda u: u not in region)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for n in sorted(region, key=order.__getitem__, reverse=True):
            if not n.users:
                graph.erase_node(n)
                gone.add(n)
        report.replacements.append(Replacement(FAMILY, "xaccel.mlstm_step", "recurrent step (xlstm native form)",
                                               location(h)))
