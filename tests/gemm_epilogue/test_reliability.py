"""Cases a fuzzer and fault injection found wrong or refused: each must run as eager does."""
import torch
import torch.nn.functional as F

import torch_xaccel
from tests.helpers import check_compiled


def _compiled(fn, *args, **kw):
    torch._dynamo.reset()
    return torch.compile(fn, backend="xaccel", **kw)(*args)


def test_a_write_to_a_base_after_its_view_is_taken_is_seen_by_the_chain():
    """rv = r.view(...); r.mul_(2): rv holds the doubled values. The chain that adds rv must not
    be fused ahead of the write (the fused op is placed right after its last input)."""
    def fn(x, w, r):
        h = x @ w.t()
        rv = r.view(-1)
        r.mul_(2)
        return torch.relu(h) + rv

    g = torch.Generator().manual_seed(0)
    x, w, r = (torch.randn(*s, generator=g) for s in ((4, 8), (8, 8), (8,)))
    with torch.no_grad():
        want = fn(x, w, r.clone())
        got = _compiled(fn, x, w, r.clone())
    torch.testing.assert_close(got, want)
    assert torch_xaccel.last_report().counts()["gemm_epilogue"] == 0


def test_a_gemm_input_whose_base_is_written_after_the_gemm_is_not_read_late():
    """The GEMM reads a view of x; x is written after the GEMM and a later operand would move the
    fused op past that write."""
    def fn(x, w, r):
        h = x.view(4, 8) @ w.t()
        x.mul_(2)
        return torch.relu(h) + r * 3

    g = torch.Generator().manual_seed(1)
    x, w, r = (torch.randn(*s, generator=g) for s in ((32,), (8, 8), (4, 8)))
    with torch.no_grad():
        want, want_x = fn(x0 := x.clone(), w, r), x0
        got, got_x = _compiled(fn, x1 := x.clone(), w, r), x1
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_x, want_x)


def test_an_extra_output_that_needs_no_gradient_does_not_require_grad():
    """y depends on no input that requires grad; the chain's final value does (b): eager gives y
    requires_grad=False, and so must the fused op's extra output (.numpy() on it works)."""
    def fn(x, w, b):
        y = torch.relu(x @ w.t())
        return y + b, y

    x, w, b = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, requires_grad=True)
    out, y = _compiled(fn, x, w, b)
    assert torch_xaccel.last_report().counts()["gemm_epilogue"] == 1
    assert out.requires_grad and not y.requires_grad
    y.numpy()
    out.sum().backward()
    assert torch.allclose(b.grad, torch.full_like(b, 4.0))


def test_a_python_bool_operand_stays_with_aten_and_raises_as_eager_does():
    def fn(x, w):
        return torch.relu(x @ w.t()) - True

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    for run in (lambda: fn(x, w), lambda: _compiled(fn, x, w)):
        try:
            run()
        except RuntimeError as e:
            assert "bool" in str(e)
        else:
            raise AssertionError("expected eager's error for a bool operand")


def test_empty_k_or_n_trains():
    """K = 0 (the GEMM is all zeros) or N = 0 (an empty output) in training: forward and gradients
    as eager's, the chain fused."""
    for K, N in ((0, 8), (4, 0)):
        x, w = torch.randn(3, 5, K, requires_grad=True), torch.randn(N, K, requires_grad=True)
        report = check_compiled(lambda x, w: torch.relu(x @ w.t()) + 1, (x, w))
        assert report.counts()["gemm_epilogue"] == 1 and not report.fallbacks, str(report)


def test_bf16_linear_with_bias_rounds_where_eager_does():
    """F.linear with a bias is one addmm in eager: one rounding. The reference (the CPU path) adds
    the bias inside the GEMM too, so pre-activations near zero give relu the same mask, and the
    forward and the weight gradient equal eager's exactly."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(80, 96, generator=g) * 0.1).bfloat16().requires_grad_()
    b = (torch.randn(80, generator=g) * 0.1).bfloat16().requires_grad_()

    def fn(x, w, b):
        return torch.relu(F.linear(x, w, b))

    def run(f):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        out = f(*leaves)
        out.float().square().sum().backward()
        return out, [t.grad for t in leaves]

    want, want_g = run(fn)
    torch._dynamo.reset()
    got, got_g = run(torch.compile(fn, backend="xaccel"))
    assert torch_xaccel.last_report().counts()["gemm_epilogue"] == 1
    assert torch.equal(got, want)
    for g_, w_ in zip(got_g, want_g):
        assert torch.equal(g_, w_)


def test_bf16_under_the_interpreter_runs_the_reference(monkeypatch):
    """Triton's interpreter computes bf16 dots wrongly: the provider declines bf16 there."""
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels
    from torch_xaccel.ops.gemm_epilogue.epilogue_ir import Epilogue

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ep = Epilogue(({"op": "acc", "index": 0}, {"op": "relu", "in": [0]}), (1,)).to_json()
    a, b = torch.randn(16, 32).bfloat16(), torch.randn(16, 32).bfloat16()
    assert triton_kernels.provider("case", a, [b], [], ep, True) is NotImplemented


def test_bf16_gradient_of_a_divisor_rounds_in_eagers_order():
    """d(x / y)/dy in bf16: -g * ((x / y) / y), ATen's order, gives eager's gradient exactly; the
    same value in another order (-g * x / (y * y)) is far from it where the sum over a row
    cancels."""
    g = torch.Generator().manual_seed(18040)
    x = torch.randn(3, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(4, 16, generator=g).bfloat16()
    d = (torch.randn(3, 1, generator=g).sign() * (0.5 + torch.rand(3, 1, generator=g))).bfloat16().requires_grad_()

    def fn(x, w, d):
        return F.linear(x, w) / d

    def grads(f):
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w, d)]
        out = f(*leaves)
        (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        return out, [leaves[0].grad, leaves[2].grad]

    want, want_g = grads(fn)
    torch._dynamo.reset()
    got, got_g = grads(torch.compile(fn, backend="xaccel"))
    assert torch_xaccel.last_report().counts()["gemm_epilogue"] == 1
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_g, want_g))
