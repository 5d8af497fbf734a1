"""Hand-written sLSTM code: a Python loop over time steps (unrolled by Dynamo) becomes one
xaccel.slstm (lowering/slstm/loops.py), a lone step one xaccel.slstm_step (step.py), each proven
numerically before it is replaced (variants.py). Compiled results and gradients equal eager within
1e-5 relative (fp32); look-alikes and what the op cannot express are left as written, with the
reason in the report."""
import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import check_compiled
from torch_xaccel.lowering import proof
from torch_xaccel.lowering.slstm import loops, variants
from torch_xaccel.lowering.slstm.plans import StateMap
from torch_xaccel.report import Report, collect

aten = torch.ops.aten
SLSTM = torch.ops.xaccel.slstm.default
STEP = torch.ops.xaccel.slstm_step.default


def _count(graphs, *targets) -> int:
    return sum(1 for g in graphs for n in g.graph.nodes if n.target in targets)


def _slstm_fallbacks(report) -> list:
    return [f.reason for f in report.fallbacks if f.family.startswith("slstm")]


def _mk(gen):
    def mk(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()
    return mk


# ---- the forms users write ----------------------------------------------------------------------

def update(raw_i, raw_f, raw_z, raw_o, c, n, m, rule="element", clamps=False, clamp_n=False, z_act=torch.tanh,
           keep=None):
    """The step's state update, as the libraries write it (keep: a list that collects i')."""
    logfm = F.logsigmoid(raw_f) + m
    m_new = torch.maximum(raw_i, logfm)
    if rule == "element":
        m_new = torch.where(n == 0, raw_i, m_new)
    elif rule == "batch":
        m_new = torch.where(torch.all(n == 0), raw_i, m_new)
    ig, fg = torch.exp(raw_i - m_new), torch.exp(logfm - m_new)
    if keep is not None:
        keep.append(ig)
    if clamps:
        ig, fg = torch.minimum(ig, torch.ones_like(ig)), fg.clamp(max=1.0)
    c = fg * c + ig * z_act(raw_z)
    n = fg * n + ig
    if clamp_n == "maximum":  # FlashRNN's form
        n = torch.maximum(n, torch.ones_like(n))
    elif clamp_n:
        n = torch.clamp(n, min=1.0)
    return torch.sigmoid(raw_o) * c / n, c, n, m_new


def einsum_stack(Wx, R, b, h=None, c=None, n=None, m=None, rule="element", z_act=torch.tanh, clamp_n=False):
    """Op layout: Wx [B, T, 4, NH, D], R [NH, 4, D, D], b [4, NH, D]; gates by unbind; outputs
    collected in a list and stacked; zero states unless given."""
    B, T, _, NH, D = Wx.shape
    if h is None:
        h = Wx.new_zeros(B, NH, D)
        c, n, m = torch.zeros_like(h), torch.zeros_like(h), torch.zeros_like(h)
    hs = []
    for t in range(T):
        raw = Wx[:, t] + torch.einsum("bhk,hgjk->bghj", h, R) + b
        h, c, n, m = update(*raw.unbind(1), c, n, m, rule=rule, z_act=z_act, clamp_n=clamp_n)
        hs.append(h)
    return torch.stack(hs, 1)


def cast_states(Wx, R, b):
    """States cast to the input dtype at every step (the xlstm package's habit): x.to(x.dtype)."""
    B, T, _, NH, D = Wx.shape
    h = Wx.new_zeros(B, NH, D)
    c, n, m = torch.zeros_like(h), torch.zeros_like(h), torch.zeros_like(h)
    hs = []
    for t in range(T):
        raw = Wx[:, t] + torch.einsum("bhk,hgjk->bghj", h.to(Wx.dtype), R) + b
        h, c, n, m = (s.to(Wx.dtype) for s in update(*raw.unbind(1), c.float(), n.float(), m.float()))
        hs.append(h)
    return torch.stack(hs, 1)


def blockdiag_buffer(x, W, R, b, h0, rule="element", clamps=True, clamp_n=True):
    """States flat [B, NH*D]; the input projected before the loop; all heads in one bmm with R
    [NH, D, 4D]; gates by chunk; h written into a preallocated buffer; h0 given, c, n, m zero."""
    B, T, _ = x.shape
    NH, D, _ = R.shape
    H = NH * D
    Wx = x @ W
    h, c, n, m = h0, torch.zeros_like(h0), torch.zeros_like(h0), torch.zeros_like(h0)
    out = x.new_empty(B, T, H)
    for t in range(T):
        rec = torch.bmm(h.view(B, NH, D).transpose(0, 1), R).view(NH, B, 4, D).permute(1, 2, 0, 3).reshape(B, 4 * H)
        i, f, z, o = (Wx[:, t] + b + rec).chunk(4, -1)
        h, c, n, m = update(i, f, z, o, c, n, m, rule=rule, clamps=clamps, clamp_n=clamp_n)
        out[:, t] = h
    return out


def perhead_index(Wx, R, b, h, c, n, m):
    """Time-major Wx [T, B, 4*NH*D]; one matmul per head; gates by indexing; the whole-batch
    fresh rule; states given and returned."""
    T, B, _ = Wx.shape
    NH, D, _ = R.shape
    hs = []
    for t in range(T):
        rec = torch.stack([h[:, k] @ R[k] for k in range(NH)], 1)  # [B, NH, 4D]
        raw = Wx[t].view(B, 4, NH, D) + rec.view(B, NH, 4, D).transpose(1, 2) + b
        h, c, n, m = update(raw[:, 0], raw[:, 1], raw[:, 2], raw[:, 3], c, n, m, rule="batch")
        hs.append(h)
    return torch.stack(hs), c, n, m


def decode_step(x_t, h, c, n, m, W, R, b):
    """One token (decoding): x_t [B, I], states [B, NH, D] in and out."""
    B, NH, D = h.shape
    raw = (x_t @ W).view(B, 4, NH, D) + torch.einsum("bhk,hgjk->bghj", h, R) + b
    return update(*raw.unbind(1), c, n, m)


def generate(x, W, R, b, V):
    """A decoding loop: each step's input is computed from the previous step's output."""
    B, NH, D = x.shape[0], R.shape[0], R.shape[2]
    h = c = n = m = x.new_zeros(B, NH, D)
    outs = []
    for _ in range(3):
        h, c, n, m = decode_step(x, h, c, n, m, W, R, b)
        outs.append(h)
        x = torch.tanh(h.reshape(B, -1) @ V)
    return torch.stack(outs, 1)


def _op_inputs(gen, B=2, T=5, NH=2, D=4, states=False, dtype=torch.float32):
    mk = _mk(gen)
    args = [mk(B, T, 4, NH, D), mk(NH, 4, D, D, scale=0.5), mk(4, NH, D)]
    if states:
        n = torch.rand(B, NH, D, generator=gen) + 0.2
        n[0, 0] = 0  # some rows start fresh, the others not
        args += [mk(B, NH, D, scale=0.5), mk(B, NH, D), n.requires_grad_(), mk(B, NH, D)]
    return [a.detach().to(dtype).requires_grad_() for a in args]


def _blockdiag_inputs(gen, B=2, T=5, NH=2, D=4, DIN=6):
    mk = _mk(gen)
    H = NH * D
    return [mk(B, T, DIN), mk(DIN, 4 * H, scale=0.5), mk(NH, D, 4 * D, scale=0.5), mk(4 * H), mk(B, H, scale=0.5)]


def _perhead_inputs(gen, B=2, T=3, NH=2, D=4):
    mk = _mk(gen)
    n = torch.rand(B, NH, D, generator=gen) + 0.2
    return [mk(T, B, 4 * NH * D), mk(NH, D, 4 * D, scale=0.5), mk(4, NH, D), mk(B, NH, D, scale=0.5), mk(B, NH, D),
            n.requires_grad_(), mk(B, NH, D)]


LOOPS = {
    "einsum, zero start": (einsum_stack, _op_inputs, "fresh=element, clamp_gates=False, clamp_n=False"),
    "einsum, states given": (einsum_stack, functools.partial(_op_inputs, states=True), "fresh=element"),
    "einsum, odd T, batch 1": (einsum_stack, functools.partial(_op_inputs, B=1, T=7), "fresh=element"),
    "einsum, states cast every step": (cast_states, _op_inputs, "fresh=element"),
    "bmm, buffer, chunk, clamps": (blockdiag_buffer, _blockdiag_inputs,
                                   "fresh=element, clamp_gates=True, clamp_n=True"),
    "bmm, buffer, chunk, no clamps": (functools.partial(blockdiag_buffer, clamps=False, clamp_n=False),
                                      _blockdiag_inputs, "fresh=element, clamp_gates=False, clamp_n=False"),
    "bmm, no fresh rule": (functools.partial(blockdiag_buffer, rule="none", clamps=False, clamp_n=False),
                           _blockdiag_inputs, "code without a fresh rule"),
    "per-head matmuls, indexing, batch rule": (perhead_index, _perhead_inputs,
                                               "fresh=batch, clamp_gates=False, clamp_n=False"),
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_hand_written_loop_becomes_one_slstm(name, lowered):
    fn, inputs, variant = LOOPS[name]
    x = inputs(torch.Generator().manual_seed(0))
    report = check_compiled(fn, x, tol=1e-5)
    assert report.counts()["slstm"] == 1 and report.counts()["slstm_step"] == 0, str(report)
    assert variant in report.replacements[0].pattern, report.replacements[0].pattern
    assert not _slstm_fallbacks(report)
    # the loop is gone from the ATen graph (forward; the training graph's copy too): one op, and
    # none of its matmuls are left for the GEMM pass (the bmm form projects the input outside)
    assert _count(lowered, SLSTM) == 1 and _count(lowered, aten.log_sigmoid.default, aten.einsum.default,
                                                  aten.bmm.default) == 0
    assert _count(lowered, aten.matmul.default) == (1 if fn is blockdiag_buffer or "bmm" in name else 0)


def test_fp64_loop_keeps_fp64():
    x = _op_inputs(torch.Generator().manual_seed(1), dtype=torch.float64)
    report = check_compiled(einsum_stack, x, tol=1e-10)
    assert report.counts()["slstm"] == 1, str(report)


def test_decode_step_becomes_slstm_step(lowered):
    gen = torch.Generator().manual_seed(2)
    mk = _mk(gen)
    B, NH, D, DIN = 2, 2, 4, 5
    n = (torch.rand(B, NH, D, generator=gen) + 0.2).requires_grad_()
    x = [mk(B, DIN), mk(B, NH, D, scale=0.5), mk(B, NH, D), n, mk(B, NH, D), mk(DIN, 4 * NH * D, scale=0.5),
         mk(NH, 4, D, D, scale=0.5), mk(4, NH, D)]
    report = check_compiled(decode_step, x, tol=1e-5)
    assert report.counts()["slstm_step"] == 1 and report.counts()["slstm"] == 0, str(report)
    assert "fresh=element" in report.replacements[0].pattern
    assert _count(lowered, STEP) == 1 and _count(lowered, aten.einsum.default) == 0


def test_loop_of_one_step_is_a_step(lowered):
    """T = 1 is no sequence: the step pass takes it (zero states passed as tensors)."""
    report = check_compiled(einsum_stack, _op_inputs(torch.Generator().manual_seed(3), T=1), tol=1e-5)
    assert report.counts()["slstm_step"] == 1 and report.counts()["slstm"] == 0, str(report)
    assert _count(lowered, STEP) == 1 and _count(lowered, SLSTM) == 0


def test_decoding_loop_keeps_one_step_op_per_token():
    """Each step's input comes from the last output: not a sequence; one slstm_step per token."""
    gen = torch.Generator().manual_seed(4)
    mk = _mk(gen)
    B, NH, D, DIN = 2, 2, 4, 5
    x = [mk(B, DIN), mk(DIN, 4 * NH * D, scale=0.5), mk(NH, 4, D, D, scale=0.5), mk(4, NH, D), mk(NH * D, DIN)]
    report = check_compiled(generate, x, tol=1e-5)
    assert report.counts()["slstm_step"] == 3 and report.counts()["slstm"] == 0, str(report)


def test_steps_replaced_one_by_one_when_only_the_step_pattern_is_on(xaccel_env):
    xaccel_env(XACCEL_PATTERNS="slstm_step")
    report = check_compiled(einsum_stack, _op_inputs(torch.Generator().manual_seed(5), T=3), tol=1e-5)
    assert report.counts()["slstm_step"] == 3 and report.counts()["slstm"] == 0, str(report)


def test_look_alike_with_sigmoid_cell_input_is_refused_once_with_the_error():
    fn = functools.partial(einsum_stack, z_act=torch.sigmoid)
    report = check_compiled(fn, _op_inputs(torch.Generator().manual_seed(6)), tol=1e-5)
    assert report.counts()["slstm"] == 0 and report.counts()["slstm_step"] == 0, str(report)
    reasons = _slstm_fallbacks(report)
    assert len(reasons) == 1 and "step 1 differs from every sLSTM variant (the closest" in reasons[0], reasons
    assert "test_lowering.py" in reasons[0]


def no_rule_with_states(Wx, R, b):
    B, T, _, NH, D = Wx.shape
    h = c = n = m = Wx.new_zeros(B, NH, D)
    for t in range(T):
        raw = Wx[:, t] + torch.einsum("bhk,hgjk->bghj", h, R) + b
        h, c, n, m = update(*raw.unbind(1), c, n, m, rule="none")
    return h, c, n, m


def gates_read(Wx, R, b):
    B, T, _, NH, D = Wx.shape
    h = c = n = m = Wx.new_zeros(B, NH, D)
    hs, ig = [], []
    for t in range(T):
        raw = Wx[:, t] + torch.einsum("bhk,hgjk->bghj", h, R) + b
        h, c, n, m = update(*raw.unbind(1), c, n, m, keep=ig)
        hs.append(h)
    return torch.stack(hs, 1), torch.stack(ig, 1)


def clamp_min_from_given_states(Wx, R, b, h, c, n, m):
    return einsum_stack(Wx, R, b, h, c, n, m, clamp_n=True)


REFUSED = {
    "no fresh rule, n clamped": (functools.partial(blockdiag_buffer, rule="none"), _blockdiag_inputs,
                                 "no fresh rule and n clamped at 1"),
    "no fresh rule, states read": (no_rule_with_states, _op_inputs, "no fresh rule: its h equals"),
    "an input gate read": (gates_read, _op_inputs, "is read outside the step"),
    "clamp(n, min=1) from a given n, training": (clamp_min_from_given_states,
                                                 functools.partial(_op_inputs, states=True), "n' = clamp(n', min=1)"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_the_op_cannot_express_is_left_as_written(name):
    fn, inputs, reason = REFUSED[name]
    report = check_compiled(fn, inputs(torch.Generator().manual_seed(7)), tol=1e-5)
    assert report.counts()["slstm"] == 0, str(report)
    reasons = _slstm_fallbacks(report)
    assert len(reasons) == 1 and reason in reasons[0], reasons


def test_clamp_min_n_clamp_is_taken_where_its_gradient_is_the_ops():
    """torch.clamp(n, min=1) passes the whole gradient at the fresh step's tie n' = 1, the op
    (torch.maximum(n, 1)) half; that reaches only a given initial n. From the zero start, or
    without gradients, it is the op's clamp_n; torch.maximum is taken from a given n too."""
    fn = functools.partial(einsum_stack, clamp_n=True)
    report = check_compiled(fn, _op_inputs(torch.Generator().manual_seed(12)), tol=1e-5)
    assert report.counts()["slstm"] == 1 and "clamp_n=True" in report.replacements[0].pattern, str(report)
    torch._dynamo.reset()
    x = [t.detach() for t in _op_inputs(torch.Generator().manual_seed(13), states=True)]
    with torch.no_grad(), collect() as graphs:
        got = torch.compile(clamp_min_from_given_states, backend="xaccel")(*x)
    assert Report(graphs=graphs).counts()["slstm"] == 1
    want = clamp_min_from_given_states(*x)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5
    torch._dynamo.reset()
    maximum = functools.partial(einsum_stack, clamp_n="maximum")
    report = check_compiled(maximum, _op_inputs(torch.Generator().manual_seed(14), states=True), tol=1e-5)
    assert report.counts()["slstm"] == 1, str(report)


def test_symbolic_sizes_beyond_the_batch_are_refused_with_the_reason():
    """dynamic=True makes the head count and head size symbolic too: the layouts are measured at
    one size of those, so the loop stays as written."""
    report = check_compiled(einsum_stack, _op_inputs(torch.Generator().manual_seed(8)), dynamic=True, tol=1e-5)
    assert report.counts()["slstm"] == 0
    assert any("dynamic shapes" in r and "batch" in r for r in _slstm_fallbacks(report)), str(report)


# forms of LOOPS with their batch dims: {input index: dim}
DYNAMIC_BATCH = {"einsum, zero start": {0: 0}, "einsum, states given": {0: 0, 3: 0, 4: 0, 5: 0, 6: 0},
                 "bmm, buffer, chunk, clamps": {0: 0, 4: 0},
                 "per-head matmuls, indexing, batch rule": {0: 1, 3: 0, 4: 0, 5: 0, 6: 0}}


@pytest.mark.parametrize("name", list(DYNAMIC_BATCH))
def test_a_symbolic_batch_size_is_collapsed_and_one_graph_serves_every_batch(name):
    """A batch dim marked dynamic (what torch.export's Dim and torch.compile's second batch size
    give): the layouts are measured and proven at the example batch size and at another, the op
    reads the batch size from its input, and the one compiled graph equals eager at other batch
    sizes, forward and gradients (flat states and a time-major Wx need reshapes at the symbolic
    size)."""
    fn, inputs, _ = LOOPS[name]
    compiled = torch.compile(fn, backend="xaccel")

    def loss(out):
        return sum((o * o.detach().sin()).sum() for o in (out if isinstance(out, tuple) else (out,)))
    with collect() as graphs:
        for B in (3, 7, 2):
            x = inputs(torch.Generator().manual_seed(B), B=B)
            for k, dim in DYNAMIC_BATCH[name].items():
                torch._dynamo.mark_dynamic(x[k], dim)
            got, want = compiled(*x), fn(*x)
            got_grads = torch.autograd.grad(loss(got), x)
            want_grads = torch.autograd.grad(loss(want), x)
            for g, w in zip((got,) if torch.is_tensor(got) else got, (want,) if torch.is_tensor(want) else want):
                assert ((g - w).norm() / w.norm()).item() <= 1e-5, B
            for g, w in zip(got_grads, want_grads):
                assert ((g - w).norm() / w.norm()).item() <= 1e-5, B
    report = Report(graphs=graphs)
    assert len(graphs) == 1 and report.counts()["slstm"] == 1, str(report)


def _time_major(Wx, R, b):
    """Wx [T, B, 4, NH, D] (each step reads Wx[t]); states head-major [NH, B, D]."""
    T, B, _, NH, D = Wx.shape
    h = c = n = m = Wx.new_zeros(NH, B, D)
    hs = []
    for t in range(T):
        raw = Wx[t].permute(1, 2, 0, 3) + torch.einsum("hbk,hgjk->ghbj", h, R) + b[:, :, None, :]
        h, c, n, m = update(*raw.unbind(0), c, n, m)
        hs.append(h)
    return torch.stack(hs, 0)


def test_a_symbolic_batch_that_is_not_the_states_leading_dim_is_refused_with_the_reason():
    """States [NH, B, D] with a symbolic B: the measured layouts follow a symbolic batch only as
    the leading dim of every tensor of the step, so the loop stays as written, with the reason;
    at a static batch size it is taken."""
    gen = torch.Generator().manual_seed(21)
    Wx, R, b = _op_inputs(gen, B=3)[:3]
    Wx = Wx.detach().transpose(0, 1).contiguous().requires_grad_()
    report = check_compiled(_time_major, [Wx, R, b], tol=1e-5)
    assert report.counts()["slstm"] == 1, str(report)
    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(Wx, 1)
    report = check_compiled(_time_major, [Wx, R, b], tol=1e-5)
    assert report.counts()["slstm"] == 0
    assert any("dynamic shapes" in r and "leading" in r for r in _slstm_fallbacks(report)), str(report)


def test_long_loop_reports_its_trace_cost():
    report = check_compiled(einsum_stack, _op_inputs(torch.Generator().manual_seed(9), B=1, T=loops.LONG_LOOP),
                            tol=1e-5)
    assert report.counts()["slstm"] == 1, str(report)
    note = report.replacements[0].note
    assert f"({note.split('(')[1].split(' ')[0]} per step)" in note and "for long sequences" in note, note


def test_graph_without_an_slstm_skips_the_search(monkeypatch):
    """The cheap filter (logsigmoid, exp, max, two squashing activations) keeps other graphs out."""
    def fail(*_):
        raise AssertionError("searched a graph without an sLSTM")
    monkeypatch.setattr(loops, "find_chains", fail)

    def mlp(x, w, f):
        return torch.tanh(x @ w) * torch.exp(F.logsigmoid(f))
    g = torch.Generator().manual_seed(10)
    report = check_compiled(mlp, [torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g),
                                  torch.randn(4, 8, generator=g)])
    assert not _slstm_fallbacks(report)


def test_proof_regimes_tell_every_variant_apart():
    """The proof's three regimes of old states make every pair of hypotheses (the op's variants,
    code without a fresh rule, an exponential forget gate) differ by far more than the accuracy
    the proof asks for, so the agreeing one is unique."""
    gen = torch.Generator().manual_seed(11)
    B, NH, D = 3, 2, 8
    state = StateMap((B, NH, D), B, NH, D, [0, 1, 2])
    hyps = variants.VARIANTS + variants.EXP_VARIANTS
    worst = {}
    for h, c, n, m in variants.regimes(state.op_shape, torch.float32, gen, zero_states=False):
        Wx, R, b = torch.randn(B, 4, NH, D, generator=gen), torch.randn(NH, 4, D, D, generator=gen) / D ** 0.5, \
            torch.randn(4, NH, D, generator=gen)
        outs = {v: variants.step_of(v)(Wx, R, b, h, c, n, m) for v in hyps}
        for u, v in itertools.combinations(hyps, 2):
            err = max(proof.rel_error(a, b_) for a, b_ in zip(outs[u], outs[v]))
            worst[(u, v)] = max(worst.get((u, v), 0.0), err)
    close = {k: e for k, e in worst.items() if e < 1e3 * proof.FACTOR * proof.ROUNDED_FLOOR}
    assert not close, close


def test_automatic_dynamic_batch_keeps_the_loop_collapsed():
    """torch.compile's default: a second batch size recompiles with the batch dim symbolic; that
    graph collapses the loop too and serves the batch sizes after it without recompiling."""
    from torch_xaccel.demo import SLSTMBlock

    torch.manual_seed(3)
    block = SLSTMBlock(16, heads=2)
    compiled = torch.compile(block, backend="xaccel")
    with collect() as graphs:
        for B in (2, 3, 6):
            x = torch.randn(B, 5, 16)
            got, want = compiled(x), block(x)
            assert ((got - want).norm() / want.norm()).item() <= 1e-5, B
    assert len(graphs) == 2, str(Report(graphs=graphs))  # the static first graph, then the symbolic one
    assert all(Report(graphs=[g]).counts()["slstm"] == 1 for g in graphs), str(Report(graphs=graphs))


def decode_step_flat(x_t, h, c, n, m, W, R, b):
    """decode_step with flat states [B, NH*D] (R [NH, 4, D, D] gives the head split)."""
    B, NH, D = h.shape[0], R.shape[0], R.shape[-1]
    raw = (x_t @ W).view(B, 4, NH, D) + torch.einsum("bhk,hgjk->bghj", h.view(B, NH, D), R) + b
    return update(*(g.reshape(B, NH * D) for g in raw.unbind(1)), c, n, m)


@pytest.mark.parametrize("fn", [decode_step, decode_step_flat], ids=["states [B, NH, D]", "flat states"])
def test_a_decode_step_with_a_symbolic_batch_is_one_step_op_for_every_batch(fn):
    """A hand-written decode step with its batch dim marked dynamic: proven at two batch sizes, one
    xaccel.slstm_step reading the batch size from its input, one graph equal to eager at others."""
    compiled = torch.compile(fn, backend="xaccel")
    NH, D, DIN = 2, 4, 5
    S = (NH, D) if fn is decode_step else (NH * D,)
    with collect() as graphs:
        for B in (3, 7, 2):
            gen = torch.Generator().manual_seed(B)
            mk = _mk(gen)
            n = (torch.rand(B, *S, generator=gen) + 0.2).requires_grad_()
            x = [mk(B, DIN), mk(B, *S, scale=0.5), mk(B, *S), n, mk(B, *S),
                 mk(DIN, 4 * NH * D, scale=0.5), mk(NH, 4, D, D, scale=0.5), mk(4, NH, D)]
            for t in x[:5]:
                torch._dynamo.mark_dynamic(t, 0)
            got, want = compiled(*x), fn(*x)
            got_grads = torch.autograd.grad(sum((g * w.detach().cos()).sum() for g, w in zip(got, want)), x)
            want_grads = torch.autograd.grad(sum((w * w.detach().cos()).sum() for w in want), x)
            for g, w in [*zip(got, want), *zip(got_grads, want_grads)]:
                assert ((g - w).norm() / w.norm()).item() <= 1e-5, B
    report = Report(graphs=graphs)
    assert len(graphs) == 1 and report.counts()["slstm_step"] == 1, str(report)
    assert "batch size symbolic" in report.replacements[0].pattern
