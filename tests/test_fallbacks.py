"""What the backend must not replace is left alone, still correct, and named in the report."""
import torch
import torch.nn.functional as F

from tests.helpers import check_compiled


def _p(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def test_float64_gemm_is_refused_with_reason():
    report = check_compiled(lambda x, w: F.gelu(x @ w.t()),
                            (_p(8, 4, dtype=torch.float64), _p(6, 4, dtype=torch.float64)))
    assert report.counts()["gemm_epilogue"] == 0
    assert any("dtype torch.float64" in f.reason for f in report.fallbacks), str(report)


def test_plain_linear_is_left_to_aten():
    report = check_compiled(lambda x, w, b: F.linear(x, w, b), (_p(8, 4), _p(6, 4), _p(6)))
    assert report.counts()["gemm_epilogue"] == 0
    assert any("nothing to fuse" in f.reason for f in report.fallbacks)


def test_unsupported_broadcast_stops_the_chain():
    # [1, S, N] against a [B, S, N] output is neither full, row, col nor scalar
    def fn(x, w, b, pos):
        return F.linear(x, w, b) + pos

    report = check_compiled(fn, (_p(2, 5, 4), _p(6, 4), _p(6), _p(1, 5, 6)))
    assert report.counts()["gemm_epilogue"] == 0
    assert any("broadcasts" in f.reason for f in report.fallbacks), str(report)


def test_dtype_cast_ends_the_chain():
    def fn(x, w):
        return torch.relu(F.linear(x, w)).double() * 2

    report = check_compiled(fn, (_p(8, 4), _p(6, 4)))
    assert report.counts()["gemm_epilogue"] == 1
    assert report.replacements[0].pattern == "linear -> relu"


def test_in_place_write_on_intermediate_is_respected():
    def fn(x, w):
        h = F.linear(x, w)
        h.mul_(3.0)
        return torch.sigmoid(h)

    x, w = torch.randn(8, 4), torch.randn(6, 4)
    report = check_compiled(fn, (x, w))
    assert report.counts()["gemm_epilogue"] == 0


def test_mutated_operand_is_not_read_early():
    def fn(x, w, r):
        y = torch.relu(F.linear(x, w))
        r.add_(1.0)
        return y + r

    x, w = torch.randn(8, 4), torch.randn(6, 4)
    r1, r2 = torch.randn(8, 6), None
    r2 = r1.clone()
    ref = fn(x, w, r1)
    out = torch.compile(fn, backend="xaccel")(x, w, r2)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6) and torch.equal(r1, r2)


def test_partial_broadcast_of_batched_operand_falls_back_but_stays_correct():
    def fn(a, b, c):
        return torch.bmm(a, b) * c  # c: [1, M, N], broadcast over the batch

    report = check_compiled(fn, (_p(3, 5, 4), _p(3, 4, 6), _p(1, 5, 6)))
    assert report.counts()["gemm_epilogue"] == 0
