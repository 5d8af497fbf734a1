"""Provenance matching: code from a known mLSTM kernel function is replaced only when running it
proves that xaccel.mlstm computes the same thing; otherwise it is left alone with a reason."""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import check_compiled
from torch_xaccel.lowering.mlstm import provenance as mlstm_provenance


def chunkwise_kernel(q, k, v, i, f):
    """Stands in for a library kernel: the chunkwise recurrence, from C = n = 0, m = 0."""
    from torch_xaccel.ops.mlstm import reference

    B, H, S, DK = q.shape
    z = q.new_zeros
    return reference.forward(q, k, v, i, f, z(B, H, DK, v.shape[-1]), z(B, H, DK), z(B, H), chunk_size=8)[0]


def wrong_kernel(q, k, v, i, f):
    """Looks like an mLSTM kernel but scales q k^T by 1/DQK instead of 1/sqrt(DQK)."""
    return chunkwise_kernel(q * math.sqrt(q.shape[-1]) ** -1, k, v, i, f)


def model(q, k, v, i, f, kernel):
    return F.silu(kernel(q, k, v, i, f)) * 2.0


@pytest.fixture
def known(monkeypatch):
    table = dict(mlstm_provenance.KNOWN)
    table[("tests/mlstm/test_provenance.py", "chunkwise_kernel")] = "test chunkwise kernel"
    table[("tests/mlstm/test_provenance.py", "wrong_kernel")] = "test wrong kernel"
    monkeypatch.setattr(mlstm_provenance, "KNOWN", table)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).requires_grad_()  # noqa: E731
    return [mk(2, 2, 20, 8), mk(2, 2, 20, 8), mk(2, 2, 20, 4), mk(2, 2, 20),
            (torch.randn(2, 2, 20, generator=g) + 2).requires_grad_()]


def test_known_kernel_is_replaced_after_verification(known):
    report = check_compiled(lambda *x: model(*x, chunkwise_kernel), _inputs(), tol=2e-5)
    assert ([r.pattern for r in report.replacements if r.family == "mlstm"]
            == ["test chunkwise kernel (verified numerically)"])


def test_kernel_that_computes_something_else_is_left_alone(known):
    report = check_compiled(lambda *x: model(*x, wrong_kernel), _inputs(1), tol=1e-6)
    assert not [r for r in report.replacements if "wrong kernel" in r.pattern]
    assert any("test wrong kernel: not replaced, no assignment" in f.reason for f in report.fallbacks), str(report)
    # its inner call (an exact mLSTM on the rescaled q) may still be proven and replaced on its own;
    # check_compiled has asserted that the result is unchanged either way
