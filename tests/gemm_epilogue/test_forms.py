"""Every GEMM + chain form the issue names is matched, replaced once, and equals eager (fp32)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import check_compiled

M, K, N = 12, 16, 24


def _p(*shape):
    return torch.randn(*shape, requires_grad=True)


class LinearGeluResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(K, N)

    def forward(self, x, res):
        return F.gelu(self.fc(x), approximate="tanh") + res


FORMS = {
    # name: (fn, input factory, expected pattern fragment)
    "F.linear+bias+gelu": (lambda x, w, b: F.gelu(F.linear(x, w, b)),
                           lambda: (_p(3, M, K), _p(N, K), _p(N)), "linear -> add(row) -> gelu"),
    "x@W.T+b silu": (lambda x, w, b: F.silu(x @ w.T + b),
                     lambda: (_p(M, K), _p(N, K), _p(N)), "matmul -> add(row) -> silu"),
    "matmul 3-D relu*2": (lambda x, w: torch.relu(torch.matmul(x, w)) * 2,
                          lambda: (_p(2, M, K), _p(K, N)), "matmul -> relu -> mul(2)"),
    "mm sigmoid": (lambda x, w: torch.sigmoid(torch.mm(x, w.t())),
                   lambda: (_p(M, K), _p(N, K)), "mm -> sigmoid"),
    "addmm tanh": (lambda b, x, w: torch.tanh(torch.addmm(b, x, w.t())),
                   lambda: (_p(N), _p(M, K), _p(N, K)), "addmm -> add(row) -> tanh"),
    "bmm + col vector": (lambda a, b, c: torch.bmm(a, b) + c,
                         lambda: (_p(2, M, K), _p(2, K, N), _p(2, M, 1)), "bmm -> add(col)"),
    "scalar chain": (lambda x, w: (1.0 - (F.linear(x, w) - 1.5) / 3.0) * 0.5,
                     lambda: (_p(M, K), _p(N, K)), "linear -> sub(1.5) -> div(3) -> sub(1) -> mul(0.5)"),
    "row and col mul": (lambda x, w, r, c: F.linear(x, w) * r * c,
                        lambda: (_p(M, K), _p(N, K), _p(N), _p(M, 1)), "linear -> mul(row) -> mul(col)"),
    "0-d tensor scale": (lambda x, w, s: F.relu(F.linear(x, w)) * s,
                         lambda: (_p(M, K), _p(N, K), _p(())), "linear -> relu -> mul(scalar)"),
    "swiglu dual gemm": (lambda x, w1, w3: F.silu(x @ w1.T) * (x @ w3.T),
                         lambda: (_p(2, M, K), _p(N, K), _p(N, K)), "matmul+matmul -> silu -> mul"),
    "geglu with biases": (lambda x, w1, b1, w3, b3: F.gelu(F.linear(x, w1, b1)) * F.linear(x, w3, b3),
                          lambda: (_p(M, K), _p(N, K), _p(N), _p(N, K), _p(N)), "linear+linear -> add(row) -> gelu"),
}


@pytest.mark.parametrize("name", list(FORMS))
def test_form_matched_and_equal(name):
    fn, make, fragment = FORMS[name]
    torch.manual_seed(hash(name) % 1000)
    report = check_compiled(fn, make())
    assert report.counts()["gemm_epilogue"] == 1, str(report)
    assert fragment in report.replacements[0].pattern, str(report)


def test_nn_linear_module_with_residual():
    torch.manual_seed(0)
    model = LinearGeluResidual()
    report = check_compiled(model, (_p(4, M, K), _p(4, M, N)))
    assert report.counts()["gemm_epilogue"] == 1
    assert report.replacements[0].pattern == "linear -> add(row) -> gelu_tanh -> add(full)"


def test_mlp_block_two_replacements_and_param_grads():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(K, N), nn.GELU(), nn.Linear(N, K), nn.Tanh())
    x = _p(5, K)
    compiled = torch.compile(mlp, backend="xaccel")
    out = compiled(x)
    out.square().sum().backward()
    got = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    mlp(x).square().sum().backward()
    for g, p in zip(got, mlp.parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-5, atol=1e-6)
    report = check_compiled(lambda x: mlp(x), (x,))
    assert report.counts()["gemm_epilogue"] == 2  # the backward runs as traced (XACCEL_BACKWARD_FUSION is off)


def test_intermediate_with_other_users_becomes_extra_output():
    def fn(x, w):
        h = F.linear(x, w) * 2.0
        return F.relu(h), h.sum(dim=0)

    report = check_compiled(fn, (_p(M, K), _p(N, K)))
    assert report.counts()["gemm_epilogue"] == 1
    assert "extra output" in report.replacements[0].pattern


def test_chain_stops_before_unsupported_op_and_says_why():
    def fn(x, w):
        return torch.exp(torch.relu(F.linear(x, w)) + 1.0)

    report = check_compiled(fn, (_p(M, K), _p(N, K)))
    assert report.replacements[0].pattern == "linear -> relu -> add(1)"
    assert "exp" in report.replacements[0].note


def test_half_precision_on_cpu_runs_reference_close_to_eager():
    torch.manual_seed(0)
    x, w, b = (torch.randn(M, K, dtype=torch.bfloat16), torch.randn(N, K, dtype=torch.bfloat16),
               torch.randn(N, dtype=torch.bfloat16))
    fn = lambda x, w, b: F.gelu(F.linear(x, w, b)) * 3.0  # noqa: E731
    # reference rounds once at the end (eager rounds after every op): bf16 has 8 bits of mantissa
    report = check_compiled(fn, (x, w, b), tol=2e-2)
    assert report.counts()["gemm_epilogue"] == 1


def test_training_saves_what_backward_reads_and_recomputes_no_gemm():
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[func] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    l1, l2 = nn.Linear(K, N), nn.Linear(N, K)

    def f(x):
        return l2(F.gelu(l1(x), approximate="tanh")) + x

    x = _p(M, K)
    y = torch.compile(f, backend="xaccel")(x)
    with CountOps() as counter:
        y.square().sum().backward()
    gemms = sum(v for k, v in counter.seen.items() if k in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default))
    assert gemms == 4  # dA and dB per layer; no forward GEMM recomputed
    assert counter.seen[torch.ops.aten.add.Tensor] <= 2  # the pre-activation is not rebuilt either


def _softcapped_loss(x, w, target):
    logits = 30.0 * torch.tanh(F.linear(x, w) / 30.0)
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten()), logits


@pytest.mark.parametrize("fallback,logits_out,switch,left", [("inductor", False, "", True),
                                                             ("inductor", True, "", False),
                                                             ("eager", False, "", False),
                                                             ("inductor", False, "0", False)])
def test_chain_feeding_only_a_fused_reduction_is_left_to_inductor(xaccel_env, fallback, logits_out, switch, left):
    """An LM head's softcap that only feeds the cross-entropy: with the Inductor rest, Inductor fuses
    the chain into the loss's own kernels, so the GEMM stays cuBLAS's and the report says why.
    Replaced as usual where the logits are also returned (they must be written anyway) or the rest
    runs eagerly (nothing else would fuse the chain), and where XACCEL_LEAVE_TO_INDUCTOR=0."""
    xaccel_env(XACCEL_FALLBACK=fallback, XACCEL_LEAVE_TO_INDUCTOR=switch)
    torch.manual_seed(7)
    target = torch.randint(0, N, (2, M))
    fn = ((lambda x, w: _softcapped_loss(x, w, target)) if logits_out
          else (lambda x, w: _softcapped_loss(x, w, target)[0]))
    report = check_compiled(fn, (_p(2, M, K), _p(N, K) * 4), tol=1e-4)
    notes = [f.reason for f in report.fallbacks if "left to Inductor" in f.reason]
    assert report.counts()["gemm_epilogue"] == (0 if left else 1), str(report)
    assert len(notes) == (1 if left else 0), str(report)
    if left:
        assert "linear -> div(30) -> tanh -> mul(30)" in notes[0] and "cross_entropy_loss" in notes[0], notes
