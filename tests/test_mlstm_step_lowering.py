"""The xlstm package's native recurrent step (decoding), called in a Python loop, becomes one
xaccel.mlstm_step per step; results, states and gradients equal eager."""
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


def test_native_step_loop_replaced_step_by_step_and_equal():
    report = check_compiled(decode_loop, _inputs(), tol=1e-5)
    assert report.counts()["mlstm_step"] == 4, str(report)
    assert report.counts()["mlstm"] == 0 and not [f for f in report.fallbacks if f.family.startswith("mlstm")]


def test_native_step_in_bf16_keeps_fp32_states():
    x = [t.detach() for t in _inputs(seed=1, grad=False)]
    x[3:6] = [t.bfloat16() for t in x[3:6]]  # q, k, v in bf16 as in a bf16 model; states fp32
    want = decode_loop(*x)
    got = torch.compile(decode_loop, backend="xaccel")(*x)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    for g, w in zip(got, want):
        assert ((g.double() - w.double()).norm() / w.double().norm()).item() < 2e-2
