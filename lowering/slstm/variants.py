"""Which variant of xaccel::slstm a step computes: the proof.

The step as written runs on random roots and old states (in the op's layout: rows with n > 0;
rows with n == 0 among others; n == 0 everywhere; DRAWS draws each), in its own dtype and in
float64 (its floats promoted: the truth), beside reference.step of every variant of the op in
float64 and in the step's dtype from the same inputs (lowering/proof.py: a variant agrees when, in
every regime and for each of h', c', n', m', it is no further from the truth than the user's code
in float64 and at most FACTOR times as far in the step's dtype). Hypotheses the op cannot express
are proven the same way, so that what agrees with them is refused by name:
- code without a fresh rule (NO_RULE, below);
- an exponential forget gate, f' = exp(f + m - m') and m' = max(i, f + m) (EXP): the op takes a
  sigmoid forget gate, logsigmoid(f) in their place. Tried only where the forget term is not a
  logsigmoid (core.Core.sigmoid_forget).
`choose` takes the one hypothesis left, and refuses when the proofs could not tell two different
ones apart.

Code without a fresh rule, m' = max(i, logsigmoid(f) + m) at every step: the op cannot express it
in general. (c, n) stand for the true state (c e^m, n e^m), and without clamps every rule evolves
the same true state (the gates enter linearly), so:
- h = o c / n is the same for every initial state and every stabilizer: such code equals the op
  (element rule, no clamps) in h;
- c, n, m agree only if the op never treats a row as fresh, i.e. n0 != 0 everywhere. From the zero
  start every row is fresh at the first step (the op's m1 = i1, the code's max(i1, logsigmoid(f1))),
  so the states differ by the factor exp(m_op - m_code) from then on;
- min(exp(.), 1) changes nothing in such code (after the max both exponents are <= 0);
- n' = max(n', 1) acts on the stabilized n and so depends on the stabilizer: from the zero start
  h1 = o tanh(z) exp(i1 - m1) there, o tanh(z) in every variant of the op.
So such code is replaced only without an n clamp and when nothing reads its c, n or m, or where a
first step written apart is the op's fresh step (prologue.py): from there n >= 1 at every step, so
no row is ever fresh again and every rule and clamp of the op computes what the code does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torch_xaccel.ops.slstm import reference

from ..proof import Refused, accuracy
from .core import Core
from .nodes import example_shape, is_zeros, val

NO_RULE = "none"  # the hypothesis "no fresh rule"; never an op variant
EXP = "exp"  # a fourth element: the hypothesis "exponential forget gate"; never an op variant
VARIANTS = [(fresh, cg, cn) for fresh in ("element", "batch") for cg in (False, True) for cn in (False, True)] + [
    (NO_RULE, False, cn) for cn in (False, True)]
EXP_VARIANTS = [(*v, EXP) for v in VARIANTS]
EXP_FORGET = "exponential forget gate: the op takes a sigmoid forget gate"
DRAWS = 3  # random draws per regime of old states in a proof


def hypotheses(core: Core) -> list:
    """What a step's proof tries: the op's variants and code without a fresh rule, and where its
    forget term is not a logsigmoid, the same with an exponential forget gate."""
    return VARIANTS if core.sigmoid_forget else VARIANTS + EXP_VARIANTS


def written_step(Wx_t, R, b, h, c, n, m, fresh, clamp_gates, clamp_n, forget=None):
    """What code the op cannot express computes (no fresh rule; an exponential forget gate), in
    the inputs' dtype: the hypotheses the proof tells apart from the op's variants. Not an op
    semantics."""
    raw = Wx_t + torch.einsum("bhk,hgjk->bghj", h, R) + b
    i, f, z, o = raw.unbind(1)
    logfm = m + (f if forget == EXP else F.logsigmoid(f))
    m_new = torch.maximum(i, logfm)
    if fresh != NO_RULE:
        m_new = torch.where((n == 0) if fresh == "element" else (n == 0).all(), i, m_new)
    ig, fg = torch.exp(i - m_new), torch.exp(logfm - m_new)
    if clamp_gates:
        ig, fg = ig.clamp(max=1.0), fg.clamp(max=1.0)
    c_new = fg * c + ig * torch.tanh(z)
    n_new = fg * n + ig
    if clamp_n:
        n_new = n_new.clamp(min=1.0)
    return torch.sigmoid(o) * c_new / n_new, c_new, n_new, m_new


def step_of(v):
    """The step function of hypothesis v: (Wx_t, R, b, h, c, n, m) -> (h', c', n', m')."""
    if len(v) == 3 and v[0] != NO_RULE:
        return lambda *ins: reference.step(*ins, *v)
    return lambda *ins: written_step(*ins, *v)


def regimes(shape, dtype, gen, zero_states: bool):
    """Old states in the op's layout: rows with n > 0; rows with n == 0 among others (c != 0
    there); n == 0 everywhere; each drawn DRAWS times. m is large, so logsigmoid(f) + m > i at
    most rows: there f' > 1 at a fresh row (clamped gates show) and the code without a fresh
    rule keeps m' != i (it shows); with n small, n' = n + i' < 1 where no row is fresh (the n
    clamp shows). So every hypothesis differs from every other in some regime (test_lowering
    checks)."""
    def r(lo, hi):
        return torch.rand(shape, generator=gen, dtype=dtype) * (hi - lo) + lo

    if zero_states:
        z = torch.zeros(shape, dtype=dtype)
        return [(z, z, z, z)] * DRAWS
    out = []
    for kind in ("warm", "some fresh", "all fresh") * DRAWS:
        h, c = torch.randn(shape, generator=gen, dtype=dtype) * 0.5, torch.randn(shape, generator=gen, dtype=dtype)
        m, n = r(2.0, 6.0), r(0.05, 0.6)
        if kind == "some fresh":
            mask = torch.rand(shape, generator=gen) < 0.5
            mask.view(-1)[0] = True
            if mask.numel() > 1:
                mask.view(-1)[-1] = False
            n = torch.where(mask, torch.zeros_like(n), n)
        elif kind == "all fresh":
            n = torch.zeros_like(n)
        out.append((h, c, n, m))
    return out


def exact(values: list) -> list:
    """The values with floating tensors in float64 (the same numbers)."""
    return [v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values]


@dataclass
class Proof:
    agree: list  # the hypotheses that hold, in the order tried
    closest: tuple  # (hypothesis, its worst Accuracy) of the one nearest to holding

    def differs(self, where: str) -> str:
        v, acc = self.closest
        return f"{where} differs from every sLSTM variant (the closest, {describe(v)}, is {acc})"


def prove(fns, state, dtype, make_inputs, hyps, zero_states=False, seed=0) -> Proof:
    """The step as written against every hypothesis. fns: the step extracted in its dtype and in
    float64; make_inputs(gen) -> (argument values for fns after the four states, op_inputs), where
    op_inputs(cast) gives Wx_t, R, b in the op's layout from cast(the root values): the plans run
    on the float64 values too, so that a sum of two roots (Wx_t and b) is exact there."""
    low, high = fns
    gen = torch.Generator().manual_seed(seed)
    worst: dict = {}
    for olds in regimes(state.op_shape, dtype, gen, zero_states):
        rest, op_inputs = make_inputs(gen)
        user = [state.run(s, to_op=False) for s in olds]
        got = [state.run(o, to_op=True) for o in low(*user, *rest)]
        truth = [state.run(o, to_op=True) for o in high(*exact(user), *exact(rest))]
        ins, ins64 = [*op_inputs(list), *olds], [*op_inputs(exact), *exact(olds)]
        for v in hyps:
            step = step_of(v)
            for acc in map(accuracy, truth, got, step(*ins64), step(*ins)):
                if v not in worst or acc.excess() > worst[v].excess():
                    worst[v] = acc
    closest = min(worst.items(), key=lambda kv: kv[1].excess())
    return Proof([v for v in hyps if worst[v].holds()], closest)


def choose(agree: list, units: int, evidence: bool) -> tuple:
    """The hypothesis among those every proof agreed with; Refused when the proofs could not tell
    two apart that differ, or where it is an exponential forget gate. Without evidence (only the
    zero states the code starts from were tried) any agreeing variant computes what the code does
    (the op's are tried first). With one unit, element and batch rules are the same rule."""
    if evidence and len(agree) > 1:
        kinds = {v[1:] for v in agree}
        if not (units == 1 and len(kinds) == 1 and NO_RULE not in {v[0] for v in agree}):
            raise Refused(f"the proof cannot tell {describe(agree[0])} from {describe(agree[1])} at this size")
    v = agree[0]
    if len(v) > 3:
        raise Refused(f"{EXP_FORGET} (f' = exp(logsigmoid(f) + m - m'); this step computes exp(f + m - m') with "
                      f"m' = max(i, f + m))")
    return v


def random_roots(cell, layout, gen, dtype, shape=None) -> list:
    """Random values for the cell's roots and shape tensors: recurrent weights scaled by
    1/sqrt(D) so that the gates stay in the range where the variants differ. shape(node): the
    shape to draw (default: the example's)."""
    D = layout.state.D
    out = []
    for j, r in enumerate([*cell.roots, *cell.consts]):
        s = (shape or example_shape)(r) or ()
        v = val(r)
        t = torch.randn(s, generator=gen, dtype=dtype if v.is_floating_point() else torch.float32)
        out.append((t / math.sqrt(D) if j in layout.recurrent else t).to(v.dtype))
    return out


def tie_refusal(core: Core, n_old, training: bool) -> str | None:
    """Why an n clamped by clamp(n, min=1) cannot be replaced (Core.n_tie_differs): only where
    gradients flow into an old n that is not a zero constant."""
    if core.n_tie_differs and training and not is_zeros(n_old):
        return ("n' = clamp(n', min=1) gives all the gradient at n' = 1 (a fresh row) to n', "
                "xaccel.slstm's clamp (torch.maximum(n', 1)) half of it: refused in training from a given n "
                "(torch.maximum(n, torch.ones_like(n)) is the op's form)")
    return None


def describe(variant) -> str:
    fresh, cg, cn = variant[:3]
    return f"fresh={fresh}, clamp_gates={cg}, clamp_n={cn}" + (", exponential forget gate" if len(variant) > 3 else "")
