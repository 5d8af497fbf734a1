"""The elementwise core of one sLSTM step, found structurally around its stabilizer's max:

    m' = max(i, F + m)  [or where(rule, i, max(...))];  i' = exp(i - m'), f' = exp(F + m - m')
    [each optionally clamped above];  c' = f' c + i' act_z(z);  n' = f' n + i' [clamped below]
    h' = act_o(o) c' / n'

F, the forget term, is logsigmoid(f) in the op; other functions of f (log(sigmoid(f)), f itself:
an exponential forget gate) pass here, and the proof names what they compute. Any unary function
of z and o, either argument order and optional clamps pass too: look-alikes reach the proof and
are refused with a number, not silently skipped.

An n clamp written clamp(n, min=1) has the op's forward but not its gradient at the tie n' = 1 of
a fresh row, where the op (as torch.maximum(n, 1), FlashRNN's form) splits it (Core.n_tie_differs):
it is replaced where that gradient cannot reach anything (variants.tie_refusal).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

from ..proof import NoMatch
from .nodes import FACTORIES, MAX, MIN, VIEWS, aten, is_op

# single-input functions a forget term may apply to the forget gate's pre-activation
_FORGET_FNS = (aten.log_sigmoid.default, aten.log.default, aten.sigmoid.default, aten.softplus.default,
               aten.neg.default, aten.mul.Tensor, aten.exp.default)


@dataclass(eq=False)
class Core:
    max: Node  # max(i, F + m): the stabilizer's max, where the search starts
    forget: Node  # F, the forget term (logsigmoid(f) in the op)
    gates: dict  # i, f, z, o -> pre-activation node
    old: dict  # c, n, m -> node
    new: dict  # h, c, n, m -> node
    # n clamped by clamp(n, min=1): at n' = 1 (a fresh row) it passes the gradient whole, where the
    # op's clamp (torch.maximum(n', 1)) splits it with the 1; the same forward, another gradient
    # for the old n
    n_tie_differs: bool = False

    @property
    def sigmoid_forget(self) -> bool:
        """F is logsigmoid(f) as the op computes it: no other forget gate need be tried."""
        return is_op(self.forget, aten.log_sigmoid.default)


def seeds(graph) -> list:
    """Every max node, in graph order: each step has one (its stabilizer's)."""
    return [n for n in graph.nodes if is_op(n, *MAX)]


def _other(node, x):
    a, b = node.args[0], node.args[1]
    return b if a is x else a if b is x else None


def _unary_input(node):
    ins = node.all_input_nodes if isinstance(node, Node) and node.op == "call_function" else []
    return ins[0] if len(ins) == 1 else None


def _exp_of_diff(x, m):
    """exp(x - m) among m's users, or None."""
    subs = [u for u in m.users if is_op(u, aten.sub.Tensor) and u.args[0] is x and u.args[1] is m]
    exps = [e for s in subs for e in s.users if is_op(e, aten.exp.default)]
    return exps[0] if len(exps) == 1 else None


def _clamped(g, upper: bool):
    """g clamped from above at 1 (min(g, 1), clamp(g, max=1)) or, upper=False, from below
    (max(g, 1), clamp(g, min=1)), if g has exactly one such user; else g. The proof decides what
    the clamp does."""
    if upper:
        users = [u for u in g.users if is_op(u, *MIN) or is_op(u, aten.clamp_max.default)
                 or (is_op(u, aten.clamp.default) and u.args[0] is g and len(u.args) > 2 and u.args[2] is not None)]
    else:
        users = [u for u in g.users if is_op(u, *MAX) or is_op(u, aten.clamp_min.default)
                 or (is_op(u, aten.clamp.default) and u.args[0] is g and len(u.args) > 1 and u.args[1] is not None)]
    return users[0] if len(users) == 1 else g


def _h_of(c_new, n_new):
    """(h', act(o)) for h' = act(o) * (c' / n') or act(o) * c' / n', either argument order."""
    for d in c_new.users:
        if is_op(d, aten.div.Tensor) and d.args[0] is c_new and d.args[1] is n_new:
            for u in d.users:
                if is_op(u, aten.mul.Tensor) and d in u.args[:2]:
                    return u, _other(u, d)
    for p in c_new.users:
        if is_op(p, aten.mul.Tensor) and c_new in p.args[:2]:
            for u in p.users:
                if is_op(u, aten.div.Tensor) and u.args[0] is p and u.args[1] is n_new:
                    return u, _other(p, c_new)
    return None, None


def _stabilizer_like(node) -> bool:
    """A value that can be the old m: an input, a constant start, or another step's m' (a max
    or a fresh rule's where), through views."""
    while is_op(node, *VIEWS):
        node = node.args[0]
    return isinstance(node, Node) and (node.op in ("placeholder", "get_attr") or is_op(node, *FACTORIES, *MAX)
                                       or is_op(node, aten.where.self))


def _forget_term(A) -> tuple:
    """(F, m) for A = F + m: F is the side that applies a function, else the side that cannot be
    a stabilizer, else the first."""
    a, b = A.args[0], A.args[1]
    if is_op(b, *_FORGET_FNS) and not is_op(a, *_FORGET_FNS) or _stabilizer_like(a) and not _stabilizer_like(b):
        return b, a
    return a, b


def forget_gate(F):
    """The forget gate's pre-activation under the forget term F: F's argument through single-input
    functions (logsigmoid, log(sigmoid(.)), -softplus(-.)), or F itself."""
    f = F
    while is_op(f, *_FORGET_FNS) and (g := _unary_input(f)) is not None:
        f = g
    return f


def find_core(mx: Node) -> Core:
    """The update around the max node mx; NoMatch with the depth reached (the deepest reading of
    mx's arguments)."""
    best = NoMatch("not max(i, F + m)", 0)
    if not is_op(mx, *MAX) or not all(isinstance(a, Node) for a in mx.args[:2]):
        raise best
    for A, i in ((mx.args[1], mx.args[0]), (mx.args[0], mx.args[1])):
        if not is_op(A, aten.add.Tensor) or not all(isinstance(a, Node) for a in A.args[:2]):
            continue
        try:
            return _core(mx, A, *_forget_term(A), i)
        except NoMatch as e:
            best = e if e.depth > best.depth else best
    raise best


def _core(mx, A, F, m_old, i) -> Core:
    depth = 2

    def need(ok, why):
        if not ok:
            e = NoMatch(why, depth)
            e.nodes = [x for x in (mx, A, F, m_new, ig0, fg0, c_new, n_new) if isinstance(x, Node)]
            raise e

    ig0 = fg0 = c_new = n_new = None  # what the walk found, for a refusal that marks it reported
    rules = [u for u in mx.users if is_op(u, aten.where.self) and {id(a) for a in u.args[1:3]} == {id(i), id(mx)}]
    m_new = rules[0] if len(rules) == 1 else mx
    ig0, fg0 = _exp_of_diff(i, m_new), _exp_of_diff(A, m_new)
    need(ig0 is not None and fg0 is not None, "the gates are not exp(i - m') and exp(F + m - m')")
    depth = 3
    ig, fg = _clamped(ig0, True), _clamped(fg0, True)
    c_old = n_old = z_act = None
    for mul in [u for u in fg.users if is_op(u, aten.mul.Tensor) and fg in u.args[:2]]:
        x = _other(mul, fg)
        for add in [u for u in mul.users if is_op(u, aten.add.Tensor) and mul in u.args[:2]]:
            y = _other(add, mul)
            if y is ig:
                n_new, n_old = add, x
            elif is_op(y, aten.mul.Tensor) and ig in y.args[:2]:
                c_new, c_old, z_act = add, x, _other(y, ig)
    need(c_new is not None and n_new is not None and isinstance(c_old, Node) and isinstance(n_old, Node),
         "no c' = f' c + i' act(z) and n' = f' n + i'")
    depth = 4
    n_sum = n_new
    n_new = _clamped(n_new, False)
    tie_differs = n_new is not n_sum and not is_op(n_new, *MAX)
    h_new, o_act = _h_of(c_new, n_new)
    need(h_new is not None, "no h' = act(o) c' / n'")
    depth = 5
    z, o = _unary_input(z_act), _unary_input(o_act)
    need(z is not None and o is not None, "the cell input or the output gate is not a function of one gate")
    gates = dict(i=i, f=forget_gate(F), z=z, o=o)
    need(len({id(g) for g in gates.values()}) == 4, "the four gates are not four tensors")
    return Core(mx, F, gates, dict(c=c_old, n=n_old, m=m_old), dict(h=h_new, c=c_new, n=n_new, m=m_new),
                tie_differs)

