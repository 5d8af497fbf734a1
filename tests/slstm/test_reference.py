"""The sLSTM reference against a float64 step loop written from the math (reference.py's
docstring) element by element, for every variant, and its analytic backward against autograd
through the reference, ties of min/max included."""
import itertools
import math

import pytest
import torch

from torch_xaccel.ops.slstm import reference, reference_backward

VARIANTS = list(itertools.product(("element", "batch"), (False, True), (False, True)))


def _scalar_loop(Wx, R, b, state, fresh, clamp_gates, clamp_n):
    """Element by element in Python floats: the oracle shares no code with the reference."""
    B, T, _, NH, D = Wx.shape
    h, c, n, m = ([[[0.0] * D for _ in range(NH)] for _ in range(B)] for _ in range(4)) if state is None else \
        ([[[float(s[bi, hh, d]) for d in range(D)] for hh in range(NH)] for bi in range(B)] for s in state)
    ys = torch.zeros(B, T, NH, D, dtype=torch.float64)
    for t in range(T):
        all_zero = all(n[bi][hh][d] == 0 for bi in range(B) for hh in range(NH) for d in range(D))
        new = [[[None] * D for _ in range(NH)] for _ in range(B)]
        for bi, hh, d in itertools.product(range(B), range(NH), range(D)):
            raw = [float(Wx[bi, t, g, hh, d] + b[g, hh, d])
                   + sum(float(R[hh, g, d, k]) * h[bi][hh][k] for k in range(D)) for g in range(4)]
            i, f, z, o = raw
            logfm = m[bi][hh][d] - math.log1p(math.exp(-f)) if f > -30 else m[bi][hh][d] + f
            fresh_here = (n[bi][hh][d] == 0) if fresh == "element" else all_zero
            m_new = i if fresh_here else max(i, logfm)
            ig, fg = math.exp(i - m_new), math.exp(logfm - m_new)
            if clamp_gates:
                ig, fg = min(ig, 1.0), min(fg, 1.0)
            c_new = fg * c[bi][hh][d] + ig * math.tanh(z)
            n_new = fg * n[bi][hh][d] + ig
            if clamp_n:
                n_new = max(n_new, 1.0)
            new[bi][hh][d] = (1 / (1 + math.exp(-o)) * c_new / n_new, c_new, n_new, m_new)
        for bi, hh, d in itertools.product(range(B), range(NH), range(D)):
            h[bi][hh][d], c[bi][hh][d], n[bi][hh][d], m[bi][hh][d] = new[bi][hh][d]
            ys[bi, t, hh, d] = h[bi][hh][d]
    finals = [torch.tensor(s, dtype=torch.float64) for s in (h, c, n, m)]
    return ys, finals


def _inputs(B, T, NH, D, state, seed):
    g = torch.Generator().manual_seed(seed)
    Wx = torch.randn(B, T, 4, NH, D, dtype=torch.float64, generator=g)
    R = torch.randn(NH, 4, D, D, dtype=torch.float64, generator=g) / D ** 0.5
    b = torch.randn(4, NH, D, dtype=torch.float64, generator=g)
    st = None
    if state:
        st = [torch.randn(B, NH, D, dtype=torch.float64, generator=g) for _ in range(4)]
        st[2] = st[2].abs()
        st[2][0] = 0  # one row fresh, the others not: the fresh rules differ
    return Wx, R, b, st


@pytest.mark.parametrize("fresh,clamp_gates,clamp_n", VARIANTS)
@pytest.mark.parametrize("state", [False, True])
def test_reference_matches_scalar_loop(fresh, clamp_gates, clamp_n, state):
    Wx, R, b, st = _inputs(3, 5, 2, 3, state, seed=len(fresh) + 2 * clamp_gates + 4 * clamp_n + 8 * state)
    y, *finals = reference.forward(Wx, R, b, *(st or [None] * 4), fresh, clamp_gates, clamp_n)
    want_y, want_finals = _scalar_loop(Wx, R, b, st, fresh, clamp_gates, clamp_n)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    for got, want in zip(finals, want_finals):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_fresh_rules_differ_on_a_partly_fresh_state():
    Wx, R, b, st = _inputs(3, 4, 2, 3, True, seed=5)
    st[3] = st[3] + 5.0  # m far from i: the rules pick different stabilizers in the fresh row
    st[1][0] = 1.0  # c != 0 where n == 0: without clamps the stabilizer cancels in c / n, with them not
    a = reference.forward(Wx, R, b, *st, "element", True, False)[0]
    c = reference.forward(Wx, R, b, *st, "batch", True, False)[0]
    assert (a[0] - c[0]).abs().max() > 1e-2
    torch.testing.assert_close(a[1:, 0], c[1:, 0])  # the rows with n > 0 agree at the first step


@pytest.mark.parametrize("fresh,clamp_gates,clamp_n", VARIANTS)
@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("T", [1, 6])
def test_analytic_backward_matches_autograd(fresh, clamp_gates, clamp_n, state, T):
    Wx, R, b, st = _inputs(3, T, 2, 4, state, seed=T + 3)
    ins = [Wx, R, b] + (st or [])
    leaves = [t.clone().requires_grad_() for t in ins]
    outs = reference.forward(*leaves[:3], *(leaves[3:] if state else [None] * 4), fresh, clamp_gates, clamp_n)
    gs = [torch.randn_like(o) for o in outs]
    want = torch.autograd.grad(outs, leaves, gs)
    got = reference_backward.backward(*gs, Wx, R, b, *(st or [None] * 4), fresh, clamp_gates, clamp_n)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_op_gradcheck_and_fp32_path():
    Wx, R, b, st = _inputs(2, 3, 1, 3, True, seed=11)
    st[2] = st[2] + 0.5  # n away from 0: no fresh row, so finite differences see no rule switch
    fn = lambda *t: torch.ops.xaccel.slstm(*t, "element", True, True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, [t.clone().requires_grad_() for t in (Wx, R, b, *st)])
    y32 = torch.ops.xaccel.slstm(Wx.float(), R.float(), b.float(), *[s.float() for s in st], "element", True, True)
    y64 = reference.forward(Wx, R, b, *st, "element", True, True)
    for a, c in zip(y32, y64):
        torch.testing.assert_close(a.double(), c, rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_the_problem():
    Wx, R, b, st = _inputs(2, 3, 2, 3, True, seed=1)
    with pytest.raises(ValueError, match="fresh must be one of"):
        torch.ops.xaccel.slstm(Wx, R, b, None, None, None, None, "rowwise", True, False)
    with pytest.raises(ValueError, match="R must be"):
        torch.ops.xaccel.slstm(Wx, R[:1], b, None, None, None, None, "batch", True, False)
    with pytest.raises(ValueError, match="all four initial states"):
        torch.ops.xaccel.slstm(Wx, R, b, st[0], None, None, None, "batch", True, False)
