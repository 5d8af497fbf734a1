"""sLSTM loops found by what they compute (issue 56): ordinary spellings of the step that the
structural walk alone missed, written fresh from the equations:
- the textbook step, logsigmoid(f) + m written out in both places it is used;
- recurrent weights stored as one [4, NH, D, D] tensor applied with bmm to h tiled over the gates;
- a first step written apart inside the loop (`if t == 0:`): zero state, no state, m = i;
and what the op cannot express, refused with the construct named: an exponential forget gate.
Each compiled loop equals eager (forward and gradients, fp32, 1e-5 relative)."""
import time

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import check_compiled, rel_err
from torch_xaccel.lowering.graph_utils import REPORTED_REGION
from torch_xaccel.report import Report, collect

aten = torch.ops.aten


def _inputs(seed, B=3, T=6, NH=2, D=4, r_shape=None, layout="bthgd"):
    """Wx [B, T, NH, 4, D] (head-major: each head's four gates together) or [B, T, 4, NH, D];
    R [NH, D, 4 D] unless r_shape; b like one step of Wx."""
    g = torch.Generator().manual_seed(seed)
    x_shape = (B, T, NH, 4, D) if layout == "bthgd" else (B, T, 4, NH, D)
    r_shape = r_shape or (NH, D, 4 * D)
    return [(torch.randn(*x_shape, generator=g)).requires_grad_(),
            (torch.randn(*r_shape, generator=g) * 0.5 / D ** 0.5).requires_grad_(),
            (torch.randn(*x_shape[2:], generator=g) * 0.5).requires_grad_()]


def _slstm(report) -> tuple:
    counts = report.counts()
    return counts["slstm"], counts["slstm_step"]


def _slstm_reasons(report) -> list:
    return [f.reason for f in report.fallbacks if f.family.startswith("slstm")]


# ---- 1. the textbook step: logsigmoid(f) + m written twice ----------------------------------------

def textbook(Wx, R, b):
    """States kept as one tuple; gates by unbind of a head-major [B, NH, 4, D]; the stabilizer
    spelled out wherever it is used, no fresh rule (zero start): h is the op's."""
    B, T, NH, _, D = Wx.shape
    zero = Wx.new_zeros(B, NH, D)
    state = (zero, zero, zero, zero)
    out = []
    for t in range(T):
        h, c, n, m = state
        gates = Wx[:, t] + torch.einsum("bhd,hde->bhe", h, R).view(B, NH, 4, D) + b
        i, f, z, o = gates.unbind(2)
        m_new = torch.maximum(F.logsigmoid(f) + m, i)
        i_ = torch.exp(i - m_new)
        f_ = torch.exp(F.logsigmoid(f) + m - m_new)
        c = f_ * c + i_ * torch.tanh(z)
        n = f_ * n + i_
        state = (torch.sigmoid(o) * c / n, c, n, m_new)
        out.append(state[0])
    return torch.stack(out, 1)


def textbook_fresh(Wx, R, b, h, c, n, m):
    """The same with the per-element fresh rule and given states, the final states returned."""
    B, T, NH, _, D = Wx.shape
    for t in range(T):
        gates = Wx[:, t] + torch.einsum("bhd,hde->bhe", h, R).view(B, NH, 4, D) + b
        i, f, z, o = gates.unbind(2)
        m_new = torch.where(n == 0, i, torch.maximum(F.logsigmoid(f) + m, i))
        c = torch.exp(F.logsigmoid(f) + m - m_new) * c + torch.exp(i - m_new) * torch.tanh(z)
        n = torch.exp(F.logsigmoid(f) + m - m_new) * n + torch.exp(i - m_new)
        m = m_new
        h = torch.sigmoid(o) * c / n
    return h, c, n, m


def _given_states(seed, B=3, NH=2, D=4):
    g = torch.Generator().manual_seed(seed)
    n = torch.rand(B, NH, D, generator=g) + 0.3
    n[0] = 0  # one batch row starts fresh
    return [t.requires_grad_() for t in (torch.randn(B, NH, D, generator=g) * 0.5, torch.randn(B, NH, D, generator=g),
                                          n, torch.randn(B, NH, D, generator=g))]


def test_the_textbook_step_with_its_stabilizer_written_twice_is_one_slstm():
    report = check_compiled(textbook, _inputs(1), tol=1e-5)
    assert _slstm(report) == (1, 0), str(report)
    assert "fresh=element" in report.replacements[0].pattern and not _slstm_reasons(report)


def textbook_on_bf16_projections(Wx, R, b):
    """A bf16 model whose sLSTM state math runs in fp32: the projections and weights cast up in the
    loop's code (the sweep's slstm_loop form in bf16)."""
    return textbook(Wx.float(), R.float(), b.float())


def test_bf16_projections_cast_up_to_an_fp32_step_are_one_slstm():
    inputs = [t.detach().bfloat16().requires_grad_() for t in _inputs(5)]
    # gradients come back in bf16: equal up to a rounding of values that agree in fp32
    report = check_compiled(textbook_on_bf16_projections, inputs, tol=2e-3)
    assert _slstm(report) == (1, 0), str(report)
    compiled = torch.compile(textbook_on_bf16_projections, backend="xaccel")
    out, ref = compiled(*inputs), textbook_on_bf16_projections(*inputs)
    assert out.dtype == torch.float32 and rel_err(out, ref) <= 1e-5  # the step itself computes in fp32


def test_the_textbook_step_with_the_fresh_rule_and_every_gate_written_per_use_is_one_slstm():
    report = check_compiled(textbook_fresh, _inputs(2) + _given_states(2), tol=1e-5)
    assert _slstm(report) == (1, 0), str(report)
    assert "fresh=element, clamp_gates=False, clamp_n=False" in report.replacements[0].pattern


# ---- 2. R as one [4, NH, D, D] tensor applied with bmm ----------------------------------------------

def bmm_tiled(Wx, R, b):
    """Wx [B, T, 4, NH, D]; R [4, NH, D_in, D_out]; h [B, NH, D] tiled over the gates with repeat
    into [4 NH, B, D] for one bmm; the batch fresh rule."""
    B, T, _, NH, D = Wx.shape
    h = c = n = m = torch.zeros(B, NH, D)
    ys = []
    for t in range(T):
        h_rep = h.transpose(0, 1).repeat(4, 1, 1)
        rec = torch.bmm(h_rep, R.view(4 * NH, D, D)).view(4, NH, B, D).permute(2, 0, 1, 3)
        i, f, z, o = (Wx[:, t] + rec + b).unbind(1)
        lf = m + F.logsigmoid(f)
        m_next = torch.where((n == 0).all(), i, torch.max(i, lf))
        f_gate, i_gate = torch.exp(lf - m_next), torch.exp(i - m_next)
        c = c * f_gate + i_gate * torch.tanh(z)
        n = n * f_gate + i_gate
        m = m_next
        h = torch.sigmoid(o) * (c / n)
        ys.append(h)
    return torch.stack(ys, 0)


def bmm_expanded_flat(Wx, R, b):
    """States flat [B, NH D]; h expanded over the gates ([4, NH, B, D] -> [4 NH, B, D]); R
    [4, NH, D, D] viewed for bmm; gates by indexing a [4, B, NH, D] tensor; only the last h."""
    B, T, _, NH, D = Wx.shape
    h = Wx.new_zeros(B, NH * D)
    c, n, m = torch.zeros_like(h), torch.zeros_like(h), torch.zeros_like(h)
    for t in range(T):
        hg = h.view(B, NH, D).transpose(0, 1).unsqueeze(0).expand(4, NH, B, D).reshape(4 * NH, B, D)
        rec = torch.bmm(hg, R.reshape(4 * NH, D, D)).view(4, NH, B, D).transpose(1, 2)
        g = Wx[:, t].transpose(0, 1) + rec + b.unsqueeze(1)
        i, f, z, o = (g[k].reshape(B, NH * D) for k in range(4))
        logfm = F.logsigmoid(f) + m
        m_new = torch.where(n == 0, i, torch.maximum(i, logfm))
        fg, ig = torch.exp(logfm - m_new), torch.exp(i - m_new)
        c = fg * c + ig * torch.tanh(z)
        n = fg * n + ig
        m = m_new
        h = torch.sigmoid(o) * c / n
    return h


@pytest.mark.parametrize("fn", [bmm_tiled, bmm_expanded_flat], ids=["repeat", "expand, flat states"])
def test_recurrent_weights_as_one_4_nh_d_d_tensor_through_bmm_are_one_slstm(fn, lowered):
    report = check_compiled(fn, _inputs(3, layout="bt4hd", r_shape=(4, 2, 4, 4)), tol=1e-5)
    assert _slstm(report) == (1, 0), str(report)
    assert not _slstm_reasons(report)
    assert sum(n.target is aten.bmm.default for g in lowered for n in g.graph.nodes) == 0


# ---- 3. a first step written apart ------------------------------------------------------------------

def first_zero_state(Wx, R, b):
    """t == 0: the state starts at zero there and the recurrent product is skipped; per-element
    fresh rule; the final states returned too."""
    B, T, NH, _, D = Wx.shape
    hs = []
    for t in range(T):
        if t == 0:
            h = c = n = m = torch.zeros(B, NH, D)
            gates = Wx[:, 0] + b
        else:
            gates = Wx[:, t] + torch.einsum("bhd,hde->bhe", h, R).view(B, NH, 4, D) + b
        i, f, z, o = gates.unbind(2)
        logfm = F.logsigmoid(f) + m
        m_new = torch.where(n == 0, i, torch.maximum(logfm, i))
        c = torch.exp(logfm - m_new) * c + torch.exp(i - m_new) * torch.tanh(z)
        n = torch.exp(logfm - m_new) * n + torch.exp(i - m_new)
        m = m_new
        h = torch.sigmoid(o) * c / n
        hs.append(h)
    return torch.stack(hs, 1), c, n, m


def first_m_from_i(Wx, R, b):
    """t == 0 sets m = i; afterwards no fresh rule; the final states returned (code without a
    fresh rule whose states are read: the op's only because its first step is the fresh one)."""
    B, T, NH, _, D = Wx.shape
    h = c = n = m = Wx.new_zeros(B, NH, D)
    hs = []
    for t in range(T):
        i, f, z, o = (Wx[:, t] + torch.einsum("bhd,hde->bhe", h, R).view(B, NH, 4, D) + b).unbind(2)
        ls = F.logsigmoid(f)
        if t == 0:
            m_new = i
        else:
            m_new = torch.maximum(ls + m, i)
        fg, ig = torch.exp(ls + m - m_new), torch.exp(i - m_new)
        c, n = fg * c + ig * torch.tanh(z), fg * n + ig
        m = m_new
        h = torch.sigmoid(o) * c / n
        hs.append(h)
    return torch.stack(hs, 1), c, n, m


def first_no_state(x, W, R, b):
    """The input projected inside the loop; no state before the first step, which writes the
    fresh step out (c = tanh(z), n = 1, m = i); afterwards no fresh rule; one output buffer."""
    B, T, _ = x.shape
    NH, D = R.shape[0], R.shape[1]
    y = x.new_empty(B, T, NH, D)
    state = None
    for t in range(T):
        gates = (x[:, t] @ W).view(B, NH, 4, D) + b
        if state is not None:
            gates = gates + torch.einsum("bhd,hde->bhe", state[0], R).view(B, NH, 4, D)
        i, f, z, o = gates.unbind(2)
        if state is None:
            c, n, m = torch.tanh(z), torch.ones_like(i), i
        else:
            _, c, n, m = state
            logfm = m + F.logsigmoid(f)
            m_new = torch.maximum(i, logfm)
            c = torch.exp(logfm - m_new) * c + torch.exp(i - m_new) * torch.tanh(z)
            n = torch.exp(logfm - m_new) * n + torch.exp(i - m_new)
            m = m_new
        state = (torch.sigmoid(o) * c / n, c, n, m)
        y[:, t] = state[0]
    return y, state[1], state[2], state[3]


def _projected(seed, B=3, T=6, NH=2, D=4, I=5):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    return [t.requires_grad_() for t in (torch.randn(B, T, I, generator=g), torch.randn(I, 4 * NH * D, generator=g) / I,
                                         torch.randn(NH, D, 4 * D, generator=g) * 0.5 / D ** 0.5,
                                         torch.randn(NH, 4, D, generator=g) * 0.5)]


FIRST = {"zero state, no recurrent product": (first_zero_state, _inputs),
         "m = i": (first_m_from_i, _inputs),
         "no state, projected in the loop": (first_no_state, _projected)}


@pytest.mark.parametrize("name", list(FIRST))
def test_a_first_step_written_apart_is_part_of_one_slstm(name, lowered):
    """The first step's own nodes are proven to be the op's first step from no state: one
    xaccel.slstm over all T steps, no initial state, nothing of the loop left."""
    fn, inputs = FIRST[name]
    report = check_compiled(fn, inputs(4), tol=1e-5)
    assert _slstm(report) == (1, 0), str(report)
    pattern = report.replacements[0].pattern
    assert "6 steps" in pattern and "its first step written apart" in pattern, pattern
    assert not _slstm_reasons(report)
    ops = [n for g in lowered for n in g.graph.nodes if n.target is torch.ops.xaccel.slstm.default]
    assert len(ops) == 1 and ops[0].args[3:7] == (None,) * 4
    assert sum(n.target in (aten.exp.default, aten.einsum.default) for g in lowered for n in g.graph.nodes) == 0


def test_long_loops_of_the_new_spellings_compile_in_seconds():
    """T = 24: the whole compile (Dynamo's trace of the unrolled loop, the passes' proof) stays
    within seconds (about 2 s each on one CPU core)."""
    for fn, x in ((first_no_state, _projected(5, T=24)), (bmm_tiled, _inputs(5, T=24, layout="bt4hd",
                                                                                  r_shape=(4, 2, 4, 4)))):
        torch._dynamo.reset()
        start = time.perf_counter()
        with collect() as graphs, torch.no_grad():
            torch.compile(fn, backend="xaccel")(*[t.detach() for t in x])
        assert Report(graphs=graphs).counts()["slstm"] == 1
        assert time.perf_counter() - start < 30, fn.__name__


# ---- 4. what the op cannot express ------------------------------------------------------------------

def exp_forget(Wx, R, b):
    """An exponential forget gate: f' = exp(f + m - m'), m' = max(f + m, i)."""
    B, T, _, NH, D = Wx.shape
    h, c, n, m = (torch.zeros(B, NH, D) for _ in range(4))
    hs = []
    for t in range(T):
        rec = torch.bmm(h.transpose(0, 1).repeat(4, 1, 1), R.view(4 * NH, D, D)).view(4, NH, B, D)
        i, f, z, o = (Wx[:, t] + rec.permute(2, 0, 1, 3) + b).unbind(1)
        m_new = torch.where(n == 0, i, torch.maximum(f + m, i))
        f_ = torch.exp(f + m - m_new)
        i_ = torch.exp(i - m_new)
        c = f_ * c + i_ * torch.tanh(z)
        n = f_ * n + i_
        m = m_new
        h = torch.sigmoid(o) * c / n
        hs.append(h)
    return torch.stack(hs, 1)


def test_an_exponential_forget_gate_is_refused_by_name_once(lowered):
    """One report line naming the construct; the loop's nodes marked as reported, so the GEMM pass
    does not report its bmms one by one."""
    report = check_compiled(exp_forget, _inputs(6, layout="bt4hd", r_shape=(4, 2, 4, 4)), tol=1e-5)
    assert _slstm(report) == (0, 0), str(report)
    reasons = _slstm_reasons(report)
    assert len(reasons) == 1 and "exponential forget gate: the op takes a sigmoid forget gate" in reasons[0], reasons
    assert "test_spellings.py" in reasons[0]
    assert not [f for f in report.fallbacks if f.family == "gemm_epilogue"], str(report)
    exps = [n for g in lowered for n in g.graph.nodes if n.target is aten.exp.default]
    assert exps and all(n.meta.get(REPORTED_REGION) for n in exps)


def test_an_exponential_forget_gate_in_one_step_is_refused_by_name():
    """A decode step with given states: the step pass names the construct too."""
    def step(Wx_t, R, b, h, c, n, m):
        i, f, z, o = (Wx_t + torch.einsum("bhd,hde->bhe", h, R).view(*h.shape[:2], 4, -1) + b).unbind(2)
        m_new = torch.maximum(f + m, i)
        c = torch.exp(f + m - m_new) * c + torch.exp(i - m_new) * torch.tanh(z)
        n = torch.exp(f + m - m_new) * n + torch.exp(i - m_new)
        return torch.sigmoid(o) * c / n, c, n, m_new

    Wx, R, b = _inputs(7, T=1)
    report = check_compiled(step, [Wx[:, 0].detach().requires_grad_(), R, b] + _given_states(7), tol=1e-5)
    assert _slstm(report) == (0, 0), str(report)
    reasons = _slstm_reasons(report)
    assert len(reasons) == 1 and "exponential forget gate" in reasons[0], reasons


def test_a_refused_loop_with_a_logsigmoid_is_marked_reported(lowered):
    """Code without a fresh rule whose c, n, m are read is refused; its logsigmoids (the mLSTM
    proof's seeds) and matmuls carry the mark."""
    def reads_states(Wx, R, b):
        B, T, NH, _, D = Wx.shape
        h = c = n = m = Wx.new_zeros(B, NH, D)
        for t in range(T):
            i, f, z, o = (Wx[:, t] + torch.einsum("bhd,hde->bhe", h, R).view(B, NH, 4, D) + b).unbind(2)
            m_new = torch.maximum(F.logsigmoid(f) + m, i)
            c = torch.exp(F.logsigmoid(f) + m - m_new) * c + torch.exp(i - m_new) * torch.tanh(z)
            n = torch.exp(F.logsigmoid(f) + m - m_new) * n + torch.exp(i - m_new)
            m = m_new
            h = torch.sigmoid(o) * c / n
        return h, c, n, m

    report = check_compiled(reads_states, _inputs(8), tol=1e-5)
    reasons = _slstm_reasons(report)
    assert len(reasons) == 1 and "no fresh rule: its h equals" in reasons[0], reasons
    marked = [n for g in lowered for n in g.graph.nodes
              if n.target in (aten.log_sigmoid.default, aten.einsum.default, aten.exp.default)]
    assert marked and all(n.meta.get(REPORTED_REGION) for n in marked)
