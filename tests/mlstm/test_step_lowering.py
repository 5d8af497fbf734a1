"""The xlstm package's native recurrent step: a loop of steps over given inputs (prefill written as
steps) becomes one xaccel.mlstm launch; a loop whose next input depends on the last output
(decoding) keeps one xaccel.mlstm_step per step. Results, states and gradients equal eager."""
import pytest
import torch

from tests.helpers import check_compiled

native_step = pytest.importorskip("mlstm_kernels.torch.recurrent.native_step")


def decode_loop(C, n, m, q, k, v, i, f):
    hs = []
    for t in range(q.shape[2]):
        h, (C, n, m) = native_step.mlstm_recurrent_step__native_fw(
            C, n, m, q[:, :, t], k[:, :, t], v[:, :, t], i[:, :, t, None], f[:, :, t, None])
        hs.append(h)
    return torch.stack(hs, 2), C, n, m


def _inputs(B=2, NH=3, S=4, DK=8, DV=16, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).requires_grad_(grad)  # noqa: E731
    return [mk(B, NH, DK, DV, scale=0.1), mk(B, NH, DK, scale=0.1), mk(B, NH, 1), mk(B, NH, S, DK), mk(B, NH, S, DK),
            mk(B, NH, S, DV), mk(B, NH, S), (torch.randn(B, NH, S, generator=g) + 2).requires_grad_(grad)]


def test_step_loop_over_a_sequence_becomes_one_launch():
    report = check_compiled(decode_loop, _inputs(), tol=1e-5)
    assert report.counts()["mlstm"] == 1 and report.counts()["mlstm_step"] == 0, str(report)
    assert "loop of 4 recurrent steps" in report.replacements[0].pattern
    assert not [f for f in report.fallbacks if f.family.startswith("mlstm")]


def generate(C, n, m, q, k, v, i, f, w):
    """Decoding: each step's input is computed from the previous output."""
    outs = []
    for _ in range(3):
        h, (C, n, m) = native_step.mlstm_recurrent_step__native_fw(C, n, m, q, k, v, i, f)
        outs.append(h)
        q = torch.tanh(h @ w)  # next query from this token's output
    return torch.stack(outs, 2), C, n, m


def test_decoding_loop_keeps_one_step_op_per_token():
    g = torch.Generator().manual_seed(2)
    mk = lambda *s: torch.randn(*s, generator=g).requires_grad_()  # noqa: E731
    B, NH, DK, DV = 2, 2, 8, 8
    x = [mk(B, NH, DK, DV), mk(B, NH, DK), mk(B, NH, 1), mk(B, NH, DK), mk(B, NH, DK), mk(B, NH, DV), mk(B, NH, 1),
         mk(B, NH, 1), mk(DV, DK)]
    report = check_compiled(generate, x, tol=1e-5)
    assert report.counts()["mlstm_step"] == 3 and report.counts()["mlstm"] == 0, str(report)


def test_native_step_in_bf16_keeps_fp32_states():
    x = [t.detach() for t in _inputs(seed=1, grad=False)]
    x[3:6] = [t.bfloat16() for t in x[3:6]]  # q, k, v in bf16 as in a bf16 model; states fp32
    want = decode_loop(*x)
    got = torch.compile(decode_loop, backend="xaccel")(*x)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    for g, w in zip(got, want):
        assert ((g.double() - w.double()).norm() / w.double().norm()).item() < 2e-2


def test_decoding_without_grad_calls_the_step_body_directly(monkeypatch):
    """With grad mode off the compiled graph calls the step op's body (ops.DIRECT_CALLS), not the
    custom-op dispatcher (a large part of a decode step's host time); same results as eager."""
    from torch_xaccel import ops
    from torch_xaccel.ops import mlstm

    assert ops.DIRECT_CALLS.get(torch.ops.xaccel.mlstm_step.default) is mlstm.op.run_step
    calls = []

    def counted(*args):
        calls.append(1)
        return mlstm.op.run_step(*args)
    monkeypatch.setitem(ops.DIRECT_CALLS, torch.ops.xaccel.mlstm_step.default, counted)
    g = torch.Generator().manual_seed(3)
    B, NH, DK, DV = 2, 2, 8, 8
    x = [torch.randn(*s, generator=g) for s in ((B, NH, DK, DV), (B, NH, DK), (B, NH, 1), (B, NH, DK), (B, NH, DK),
                                                (B, NH, DV), (B, NH, 1), (B, NH, 1), (DV, DK))]
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(generate, backend="xaccel")(*x)
        want = generate(*x)
    assert len(calls) == 3
    for a, b in zip(got, want):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
