"""Real code: FlashRNN 1.0.8's sLSTM on its PyTorch backends compiles through the backend with the
per-step loop traced as one xaccel.slstm (lowering/slstm/substitutions.py): `vanilla` (plain
autograd) in forward and gradients, `vanilla_fwbw` without gradients; with gradients vanilla_fwbw
keeps its own hand-written backward (it holds m constant) and runs the library's code. Every
step's states, which flashrnn returns, stay truthful; fp32 within 1e-5 relative of eager."""
import pytest
import torch

from tests.helpers import rel_err
from torch_xaccel.report import Report, collect

flashrnn_pkg = pytest.importorskip("flashrnn")
from flashrnn import flashrnn  # noqa: E402
from flashrnn.flashrnn.vanilla_fwbw.fw import forward_sequence, slstm_pointwise_fw  # noqa: E402

TOL = 1e-5


def _inputs(B=3, T=7, NH=2, D=8, seed=0, state=False, dtype=torch.float32, n_zero=None):
    """Wx [B, T, 4, NH, D], R [4, NH, D, D] / sqrt(D), b [4, NH, D] (the README's layouts), and
    optionally a random initial state [4, B, 1, NH, D] with n > 0, or n = 0 in the batch rows
    n_zero (then m is raised by 3, so that a fresh step's forget gate exceeds 1 unclamped)."""
    gen = torch.Generator().manual_seed(seed)
    Wx = torch.randn(B, T, 4, NH, D, generator=gen)
    R = torch.randn(4, NH, D, D, generator=gen) / D ** 0.5
    b = torch.randn(4, NH, D, generator=gen)
    tensors = [Wx, R, b]
    if state:
        s = torch.randn(4, B, 1, NH, D, generator=gen)
        s[2] = s[2].abs() + 0.5
        if n_zero is not None:
            s[2, n_zero] = 0.0
            s[3] += 3.0
        tensors.append(s)
    return [t.to(dtype).requires_grad_() for t in tensors]


def _loss(outs):
    gen = torch.Generator().manual_seed(7)
    return sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)


def _compare(fn, inputs, grad=True, tol=TOL):
    """fn eagerly and compiled: outputs (and the inputs' gradients of a loss on all of them)
    within tol; returns the compile's report."""
    leaves = [t for t in inputs if t.requires_grad] if grad else []
    want = fn(*inputs)
    want_grads = torch.autograd.grad(_loss(want), leaves) if leaves else ()
    torch._dynamo.reset()
    with collect() as graphs:
        got = torch.compile(fn, backend="xaccel")(*inputs)
    got_grads = torch.autograd.grad(_loss(got), leaves) if leaves else ()
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert rel_err(g, w) <= tol, rel_err(g, w)
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) <= tol, rel_err(g, w)
    return Report(graphs=graphs)


def _vanilla(Wx, R, b, states=None):
    return flashrnn(Wx, R, b, states=states, function="slstm", backend="vanilla")


@pytest.mark.parametrize("T", [7, 1])
def test_vanilla_substituted_with_every_step_states_equal_to_eager(T):
    """All of flashrnn's outputs (h, c, n, m of every step, the last states): the states between
    the first and the last step are recomputed, and their gradients flow."""
    report = _compare(_vanilla, _inputs(T=T))
    family = "slstm" if T > 1 else "slstm_step"
    assert report.counts()[family] == 1, str(report)
    ours = report.replacements[0]
    assert ours.pattern == "FlashRNN vanilla sLSTM (substituted while Dynamo traced)" and ours.op == f"xaccel.{family}"
    assert ("recomputed" in ours.note) == (T > 1)


@pytest.mark.parametrize("T", [9, 33])
def test_vanilla_reading_h_only_runs_the_op_alone(T):
    """The usual use, states[0] and the last states: nothing reads the steps in between, so the
    recomputation is dropped; forward and gradients equal eager."""
    def fn(Wx, R, b):
        states, last = _vanilla(Wx, R, b)
        return states[0], last

    report = _compare(fn, _inputs(T=T, NH=4, D=16))
    assert report.counts()["slstm"] == 1 and not report.replacements[0].note, str(report)


def _given_state(**kw):
    """Inputs with an initial state that takes no gradient (Wx, R and b do)."""
    Wx, R, b, s = _inputs(state=True, **kw)
    return [Wx, R, b, s.detach()]


def test_vanilla_with_a_given_state_equal_to_eager():
    report = _compare(lambda Wx, R, b, s: _vanilla(Wx, R, b, states=s), _given_state(T=5))
    assert report.counts()["slstm"] == 1, str(report)


@pytest.mark.parametrize("n_zero", [slice(None), [0]])
def test_vanilla_fresh_rule_is_whole_batch(n_zero):
    """FlashRNN's fresh rule is `torch.where(torch.all(n == 0.0), ...)`: n zero everywhere restarts
    every row (its forget gate not clamped at 1), zero in some rows restarts none."""
    report = _compare(lambda Wx, R, b, s: _vanilla(Wx, R, b, states=s), _given_state(T=4, n_zero=n_zero))
    assert report.counts()["slstm"] == 1, str(report)


def test_vanilla_with_a_state_taking_gradients_equal_to_eager():
    """FlashRNN's n clamp, torch.maximum(n', 1), splits its gradient where n' is exactly 1 (every
    fresh step from n = 0), and so does the op's: an initial state's gradient agrees too."""
    report = _compare(lambda Wx, R, b, s: _vanilla(Wx, R, b, states=s), _inputs(T=4, state=True, n_zero=[0]))
    assert report.counts()["slstm"] == 1, str(report)


def test_vanilla_fwbw_without_gradients_substituted_and_equal_to_eager():
    inputs = [t.detach() for t in _inputs(T=9)]

    def fn(Wx, R, b):
        return flashrnn(Wx, R, b, function="slstm", backend="vanilla_fwbw", dtype="float32")

    with torch.no_grad():
        report = _compare(fn, inputs, grad=False)
    assert report.counts()["slstm"] == 1, str(report)
    assert report.replacements[0].pattern.startswith("FlashRNN vanilla_fwbw sLSTM without gradients")


def test_vanilla_fwbw_with_gradients_runs_its_own_backward():
    """With inputs that require grad, vanilla_fwbw is not substituted (its backward holds m
    constant, the op's does not): the library's forward and hand-written backward run, equal to
    eager's."""
    def fn(Wx, R, b, s):
        states, last = flashrnn(Wx, R, b, states=s, function="slstm", backend="vanilla_fwbw", dtype="float32")
        return states[0], last

    report = _compare(fn, _given_state(T=7))
    assert report.counts()["slstm"] == 0 and report.counts()["slstm_step"] == 0, str(report)


def test_forward_sequence_substituted_with_gradients():
    """vanilla_fwbw's forward_sequence alone differentiates by autograd through its loop, m
    included, as the op does: substituted with gradients too (for Wx, R and b; a state taking
    gradients runs the library's loop, as for the vanilla backend)."""
    Wx, R, b = _inputs(T=6)
    s0 = torch.randn(4, 3, 2, 8)
    s0[2] = s0[2].abs() + 0.5

    def fn(s0, Wx, R, b):
        return forward_sequence(s0, Wx, R, b, slstm_pointwise_fw)

    report = _compare(fn, [s0, Wx, R, b])
    assert report.counts()["slstm"] == 1, str(report)


def test_flashrnn_lstm_function_traces_the_library_code():
    def fn(Wx, R, b):
        return flashrnn(Wx, R, b, function="lstm", backend="vanilla")[0]

    gen = torch.Generator().manual_seed(0)
    Wx, R = torch.randn(2, 5, 4, 2, 8, generator=gen), torch.randn(4, 2, 8, 8, generator=gen) / 3
    b = torch.randn(4, 2, 8, generator=gen)
    want = fn(Wx, R, b)
    torch._dynamo.reset()
    with collect() as graphs:
        got = torch.compile(fn, backend="xaccel")(Wx, R, b)
    assert rel_err(got, want) <= 1e-6
    assert Report(graphs=graphs).counts()["slstm"] == 0


@pytest.mark.parametrize("env", [{"XACCEL_DISABLE": "1"}, {"XACCEL_PATTERNS": "gemm_epilogue"}])
def test_switched_off_runs_the_library_code(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    report = _compare(_vanilla, _inputs(T=5))
    assert report.counts()["slstm"] == 0, str(report)


@pytest.mark.parametrize("backend", ["vanilla", "vanilla_fwbw"])
def test_bf16_forward_keeps_the_library_dtypes_and_stays_close_to_eager(backend):
    """bf16 inputs: every output in bf16 as eager's, within 2e-2 relative of FlashRNN's own bf16
    math (which rounds every intermediate; the op keeps its states in fp32)."""
    inputs = [t.detach() for t in _inputs(T=9, dtype=torch.bfloat16)]

    def fn(Wx, R, b):
        return flashrnn(Wx, R, b, function="slstm", backend=backend, dtype="bfloat16")

    with torch.no_grad():
        want = fn(*inputs)
        torch._dynamo.reset()
        with collect() as graphs:
            got = torch.compile(fn, backend="xaccel")(*inputs)
    assert Report(graphs=graphs).counts()["slstm"] == 1
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.bfloat16 and g.shape == w.shape
        assert rel_err(g[0], w[0]) <= 2e-2  # h of every step (c, n, m: see the next assertion)
        assert rel_err(g, w) <= 2e-2


_LATE_IMPORT = """
import sys, torch
import torch_xaccel.backend  # the hooks first; the libraries after, vanilla_fwbw only inside flashrnn's trace
from torch_xaccel.report import Report, collect
assert "flashrnn.flashrnn.vanilla_fwbw.fwbw" not in sys.modules and "xlstm.blocks.slstm.src.vanilla" not in sys.modules
from flashrnn import flashrnn
from xlstm.blocks.slstm.layer import sLSTMLayer, sLSTMLayerConfig
torch.manual_seed(0)
Wx, R, b = torch.randn(2, 5, 4, 2, 8), torch.randn(4, 2, 8, 8) / 3, torch.randn(4, 2, 8)
fn = lambda Wx, R, b: flashrnn(Wx, R, b, function="slstm", backend="vanilla_fwbw", dtype="float32")[0]
layer = sLSTMLayer(sLSTMLayerConfig(embedding_dim=32, num_heads=2, backend="vanilla"))
x = torch.randn(2, 5, 32)
with torch.no_grad(), collect() as graphs:
    assert (torch.compile(fn, backend="xaccel")(Wx, R, b) - fn(Wx, R, b)).abs().max() < 1e-5
    assert (torch.compile(layer, backend="xaccel")(x) - layer(x)).abs().max() < 1e-5
print(Report(graphs=graphs).counts()["slstm"])
"""


def test_libraries_imported_after_the_backend_are_substituted_at_their_first_compile():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _LATE_IMPORT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "2"
