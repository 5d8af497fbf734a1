"""mLSTM code in forms the structural walks do not know, found by its data flow and replaced only
after running it on random inputs proves it equal to xaccel.mlstm / mlstm_step: a Python loop of
recurrent steps, a single hand-written step, calls that return their final states or start from
given ones; and einsum forms, which the structural walk knows. Every replacement equals eager in
forward and gradients (fp32); look-alikes are refused and reported once with the step that
failed."""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import check_compiled

TOL = 2e-5


def einsum_where_scale_on_k(q, k, v, i, f):
    """The parallel form with einsum products, the scale on k and a where-mask from aranges."""
    S, D = q.shape[-2], q.shape[-1]
    Fc = torch.cumsum(F.logsigmoid(f), -1)
    causal = torch.arange(S, device=q.device)[:, None] >= torch.arange(S, device=q.device)[None, :]
    logD = torch.where(causal, Fc[..., :, None] - Fc[..., None, :] + i[..., None, :], -torch.inf)
    m = logD.max(-1, keepdim=True).values
    scores = torch.einsum("bhtd,bhsd->bhts", q, k * D ** -0.5) * torch.exp(logD - m)
    n = torch.maximum(scores.sum(-1, keepdim=True).abs(), torch.exp(-m))
    return torch.einsum("bhts,bhsd->bhtd", scores / (n + 1e-6), v)


def einsum_column_gates(q, k, v, i, f):
    """The same with gates [B, NH, S, 1] (transposed into rows) and a triu mask via masked_fill."""
    S, D = q.shape[-2], q.shape[-1]
    Fc = torch.cumsum(F.logsigmoid(f), -2)
    logD = Fc - Fc.transpose(-1, -2) + i.transpose(-1, -2)
    logD = logD.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    m = logD.amax(-1, keepdim=True)
    scores = torch.einsum("bhtd,bhsd->bhts", q, k / math.sqrt(D)) * torch.exp(logD - m)
    n = torch.maximum(scores.sum(-1, keepdim=True).abs(), torch.exp(-m))
    return torch.einsum("bhts,bhsd->bhtd", scores / (n + 1e-6), v)


def steps(q, k, v, i, f, C=None, n=None, m=None, states=False, input_gate=torch.exp):
    """A Python loop of recurrent steps (Dynamo unrolls it): k scaled, m [B, NH], einsum updates;
    from zeros unless a start state is given; the final state returned with `states`."""
    B, H, S, D = q.shape
    if C is None:
        C, n, m = q.new_zeros(B, H, D, v.shape[-1]), q.new_zeros(B, H, D), q.new_zeros(B, H)
    hs = []
    for t in range(S):
        logf = F.logsigmoid(f[:, :, t])
        m_new = torch.maximum(logf + m, i[:, :, t])
        fg, ig = torch.exp(logf + m - m_new), input_gate(i[:, :, t] - m_new)
        kt = k[:, :, t] / math.sqrt(D)
        C = fg[..., None, None] * C + ig[..., None, None] * torch.einsum("bhd,bhe->bhde", kt, v[:, :, t])
        n = fg[..., None] * n + ig[..., None] * kt
        num = torch.einsum("bhd,bhde->bhe", q[:, :, t], C)
        den = torch.maximum(torch.einsum("bhd,bhd->bh", q[:, :, t], n).abs(), torch.exp(-m_new)) + 1e-6
        hs.append(num / den[..., None])
        m = m_new
    h = torch.stack(hs, dim=2)
    return (h, C, n, m) if states else h


def one_step(q, k, v, i, f, C, n, m):
    """One hand-written decoding step: gates and m [B, NH, 1], q scaled (states hold unscaled k)."""
    logf = F.logsigmoid(f)
    m_new = torch.max(logf + m, i)
    fg, ig = torch.exp(logf + m - m_new), torch.exp(i - m_new)
    C = fg[..., None] * C + ig[..., None] * (k[..., :, None] * v[..., None, :])
    n = fg * n + ig * k
    qs = q * q.shape[-1] ** -0.5
    den = torch.maximum((qs * n).sum(-1, keepdim=True).abs(), torch.exp(-m_new)) + 1e-6
    return (qs[..., None, :] @ C).squeeze(-2) / den, C, n, m_new


def chunkwise(q, k, v, i, f, L=8):
    """A hand-written chunkwise mLSTM (the op's own reference) from the xlstm start state, states
    returned, followed by more code in the same layout (cut off by the proof)."""
    from torch_xaccel.ops.mlstm import reference

    B, H, S, DK = q.shape
    z = q.new_zeros
    h, C, n, m = reference.forward(q, k, v, i, f, z(B, H, DK, v.shape[-1]), z(B, H, DK), z(B, H), chunk_size=L)
    return F.silu(h) * 2.0, C, n, m


def _inputs(B=2, H=3, S=13, DK=8, DV=6, seed=0, column_gates=False, state=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).requires_grad_()  # noqa: E731
    gate = (B, H, S, 1) if column_gates else (B, H, S)
    x = [mk(B, H, S, DK), mk(B, H, S, DK), mk(B, H, S, DV), mk(*gate),
         (torch.randn(*gate, generator=g) + 2).requires_grad_()]
    if state:
        x += [mk(B, H, DK, DV), mk(B, H, DK), mk(B, H)]
    return x


def _mlstm_lines(report) -> list:
    return [r for r in report.replacements if r.family in ("mlstm", "mlstm_step")]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("fn,column", [(einsum_where_scale_on_k, False), (einsum_column_gates, True)])
def test_einsum_forms_are_found_by_the_walk(fn, column, dynamic):
    """einsum products, an arange mask, column gates: spellings the structural walk knows, so no
    proof runs (tests/mlstm/test_spellings.py has the proof's forms)."""
    report = check_compiled(fn, _inputs(S=21, seed=1, column_gates=column), dynamic=dynamic, tol=TOL)
    assert report.counts()["mlstm"] == 1, str(report)
    assert _mlstm_lines(report)[0].pattern == "parallel stabilized form"
    assert not [fb for fb in report.fallbacks if fb.family in ("mlstm", "gemm_epilogue")], str(report)


@pytest.mark.parametrize("states", [False, True])
@pytest.mark.parametrize("given", [False, True])
def test_loop_of_steps_is_one_mlstm_with_its_final_states(states, given):
    """The unrolled loop (odd S) becomes one xaccel.mlstm from its start state: zeros made inside,
    or given as inputs (gradients flow to them); with its final C, n, m as extra outputs."""
    x = _inputs(S=7, seed=2, state=given)
    report = check_compiled(lambda *a: steps(*a, states=states), x, tol=TOL)
    assert report.counts()["mlstm"] == 1 and report.counts()["mlstm_step"] == 0, str(report)
    pattern = _mlstm_lines(report)[0].pattern
    assert ("from its start state" if given else "from a zero state") in pattern, pattern
    assert ("final C/n/m" in pattern) == states, pattern


def test_loop_of_steps_under_dynamic_shapes():
    report = check_compiled(lambda *a: steps(*a, states=True), _inputs(S=5, seed=3, state=True), dynamic=True,
                            tol=TOL)
    assert report.counts()["mlstm"] == 1, str(report)


@pytest.mark.parametrize("dynamic", [False, True])
def test_chunkwise_code_with_final_states_and_code_after_it(dynamic):
    report = check_compiled(chunkwise, _inputs(S=19, seed=4), dynamic=dynamic, tol=TOL)
    assert report.counts()["mlstm"] == 1, str(report)
    assert "from a zero state, final C/n/m" in _mlstm_lines(report)[0].pattern


def _step_inputs(seed=5, B=3, H=2, DK=8, DV=6):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).requires_grad_()  # noqa: E731
    return [mk(B, H, DK), mk(B, H, DK), mk(B, H, DV), mk(B, H, 1), mk(B, H, 1), mk(B, H, DK, DV), mk(B, H, DK),
            mk(B, H, 1)]


@pytest.mark.parametrize("dynamic", [False, True])
def test_single_hand_written_step_is_mlstm_step(dynamic):
    report = check_compiled(one_step, _step_inputs(), dynamic=dynamic, tol=TOL)
    assert report.counts()["mlstm_step"] == 1, str(report)
    assert "mLSTM proven numerically (from its start state, final C/n/m, eps 1e-06)" in _mlstm_lines(report)[0].pattern


def test_single_step_follows_the_step_pattern_switch(xaccel_env):
    xaccel_env(XACCEL_PATTERNS="mlstm,gemm_epilogue")
    report = check_compiled(one_step, _step_inputs(seed=9), tol=1e-6)
    assert report.counts()["mlstm_step"] == 0 and report.counts()["mlstm"] == 0, str(report)


def test_a_changed_gate_is_refused_and_reported_once():
    """The same loop with a sigmoid input gate instead of exp: it looks like an mLSTM, the proof
    fails, the model runs as written (equal to eager), and one report line names the step."""
    report = check_compiled(lambda *a: steps(*a, input_gate=torch.sigmoid), _inputs(S=6, seed=6), tol=1e-6)
    assert report.counts()["mlstm"] == 0 and report.counts()["mlstm_step"] == 0
    lines = [fb.reason for fb in report.fallbacks if fb.family == "mlstm"]
    assert len(lines) == 1, str(report)
    assert "no reading of its inputs as (q, k, v, i, f) makes xaccel.mlstm reproduce its output h" in lines[0]


def wrong_scale(q, k, v, i, f):
    """The einsum form with 1/DQK on q k^T instead of 1/sqrt(DQK), all of it inside the form (a
    q / sqrt(DQK) before the call would only be another q)."""
    S, D = q.shape[-2], q.shape[-1]
    Fc = torch.cumsum(F.logsigmoid(f), -1)
    logD = (Fc[..., :, None] - Fc[..., None, :] + i[..., None, :]).masked_fill(
        torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    m = logD.max(-1, keepdim=True).values
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) / D * torch.exp(logD - m)
    n = torch.maximum(scores.sum(-1, keepdim=True).abs(), torch.exp(-m))
    return torch.einsum("bhts,bhsd->bhtd", scores / (n + 1e-6), v)


def scores_also_returned(q, k, v, i, f):
    """The einsum form whose weighted scores are also a result (not one the op has)."""
    S, D = q.shape[-2], q.shape[-1]
    Fc = torch.cumsum(F.logsigmoid(f), -1)
    logD = (Fc[..., :, None] - Fc[..., None, :] + i[..., None, :]).masked_fill(
        torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    m = logD.amax(-1, keepdim=True)
    scores = torch.einsum("bhtd,bhsd->bhts", q, k * D ** -0.5) * torch.exp(logD - m)
    n = torch.maximum(scores.sum(-1, keepdim=True).abs(), torch.exp(-m))
    return torch.einsum("bhts,bhsd->bhtd", scores / (n + 1e-6), v), scores


def matmul_form_wrong_scale(q, k, v, i, f):
    """The parallel form written with @ (4-D matmuls the GEMM pass does not take) and 1/DQK on
    q k^T instead of 1/sqrt(DQK)."""
    S, D = q.shape[-2], q.shape[-1]
    Fc = torch.cumsum(F.logsigmoid(f), -1)
    logD = (Fc[..., :, None] - Fc[..., None, :] + i[..., None, :]).masked_fill(
        torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    m = logD.amax(-1, keepdim=True)
    scores = (q @ k.transpose(-1, -2)) / D * torch.exp(logD - m)
    n = torch.maximum(scores.sum(-1, keepdim=True).abs(), torch.exp(-m))
    return (scores / (n + 1e-6)) @ v


def test_a_refused_region_is_one_report_line_not_gemm_fallbacks_too():
    """Its matmuls belong to the one mLSTM line; the GEMM pass does not list them again."""
    report = check_compiled(matmul_form_wrong_scale, _inputs(S=9, seed=7), tol=1e-6)
    assert report.counts()["mlstm"] == 0
    assert len([fb for fb in report.fallbacks if fb.family == "mlstm"]) == 1, str(report)
    assert not [fb for fb in report.fallbacks if fb.family == "gemm_epilogue"], str(report)


def test_code_after_the_final_states_stays():
    """Reads of the final states in the same layout (m * 2, a reduction of C) stay in the graph,
    computed from the op's extra outputs."""
    def fn(*x):
        h, C, n, m = steps(*x, states=True)
        return h, m * 2.0, C.sum(-1).exp()

    report = check_compiled(fn, _inputs(S=9, seed=8), tol=TOL)
    assert report.counts()["mlstm"] == 1, str(report)
    assert "final C/m" in _mlstm_lines(report)[0].pattern


@pytest.mark.parametrize("fn,reason", [(wrong_scale, "reproduce its output h"),
                                       (scores_also_returned, "a value other than h and the final states leaves it")])
def test_look_alikes_are_left_alone(fn, reason):
    report = check_compiled(fn, _inputs(S=9, seed=7), tol=1e-6)
    assert report.counts()["mlstm"] == 0
    lines = [fb.reason for fb in report.fallbacks if fb.family == "mlstm"]
    assert len(lines) == 1 and reason in lines[0], str(report)


def slstm_like_loop(*args, T=24):
    """An sLSTM-shaped loop over per-step gate inputs (4T + 1 same-shaped tensors) with a slip that
    makes it no sLSTM (sigmoid(z) for tanh(z)): its log-sigmoids look mLSTM-like."""
    gates, R = args[:4 * T], args[4 * T]
    B, NH, D = gates[0].shape
    h = c = n = m = torch.zeros(B, NH, D, device=R.device)
    ys = []
    for t in range(T):
        rec = torch.einsum("bhd,hde->bhe", h, R)
        i, f, z, o = (g + rec for g in gates[4 * t: 4 * t + 4])
        logf = F.logsigmoid(f)
        m_new = torch.maximum(logf + m, i)
        ig, fg = torch.exp(i - m_new), torch.exp(logf + m - m_new)
        c, n = fg * c + ig * torch.sigmoid(z), fg * n + ig
        h, m = torch.sigmoid(o) * c / n, m_new
        ys.append(h)
    return torch.stack(ys, 1)


def test_a_look_alike_with_many_inputs_is_refused_without_enumerating_readings(xaccel_env):
    """Its 97 inputs are not read in every order (that took minutes at T = 16): the forget gate
    comes from data flow, and 96 different inputs reaching the log-sigmoids is no mLSTM. The sLSTM
    pass is off, so the mLSTM proof is what meets it (benchmarks/compile_bounds.py times it)."""
    xaccel_env(XACCEL_PATTERNS="mlstm,mlstm_step")
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(2, 2, 8, generator=g) for _ in range(96)] + [torch.randn(2, 8, 8, generator=g) * 0.3]
    report = check_compiled(slstm_like_loop, x, tol=1e-6)
    lines = [fb.reason for fb in report.fallbacks if fb.family == "mlstm"]
    assert report.counts()["mlstm"] == 0 and len(lines) == 1, str(report)
    assert "its log-sigmoids read 96 different inputs" in lines[0], lines[0]
