"""CUDA: compiled models with gemm_epilogue ops against the fp32 reference, bf16 and fp16."""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err
from torch_xaccel.report import Report, collect

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(128, 256, 384), (333, 128, 200)])
def test_linear_gelu_residual_matches_fp32_reference(dtype, M, K, N):
    torch.manual_seed(M + N)
    x = torch.randn(M, K, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5).requires_grad_()
    b = torch.randn(N, device="cuda", dtype=dtype, requires_grad=True)
    res = torch.randn(M, N, device="cuda", dtype=dtype, requires_grad=True)

    def fn(x, w, b, res):
        return F.gelu(F.linear(x, w, b), approximate="tanh") + res

    with collect() as graphs:
        out = torch.compile(fn, backend="xaccel")(x, w, b, res)
    assert Report(graphs=graphs).counts()["gemm_epilogue"] == 1
    leaves = [x, w, b, res]
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, cot)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = fn(*ref_leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves, cot.double())
    assert rel_err(out, ref) <= 1e-2
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 5e-2


def test_swiglu_dual_gemm_bf16():
    torch.manual_seed(0)
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    w1, w3 = (torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16) / 16).unbind(0)

    def fn(x, w1, w3):
        return F.silu(x @ w1.T) * (x @ w3.T)

    with collect() as graphs:
        out = torch.compile(fn, backend="xaccel")(x, w1, w3)
    assert Report(graphs=graphs).counts()["gemm_epilogue"] == 1
    assert rel_err(out, fn(x.double(), w1.double(), w3.double())) <= 1e-2


@pytest.mark.parametrize("act,grad_op", [("gelu_tanh", "gelu_tanh_grad"), ("relu", "relu_grad")])
def test_mlp_backward_fusion_bf16_matches_fp64_reference(act, grad_op, monkeypatch):
    """The backward's fused GEMM + activation gradient and GEMM + residual gradient (generated
    kernels or ATen, whichever the tuner picked) against float64 autograd."""
    monkeypatch.setenv("XACCEL_BACKWARD_FUSION", "1")
    torch.manual_seed(1)
    M, d, h = 333, 256, 512
    fn_act = (lambda t: F.gelu(t, approximate="tanh")) if act == "gelu_tanh" else F.relu
    leaves = [torch.randn(M, d, device="cuda", dtype=torch.bfloat16),
              torch.randn(h, d, device="cuda", dtype=torch.bfloat16) / d ** 0.5,
              torch.randn(h, device="cuda", dtype=torch.bfloat16),
              torch.randn(d, h, device="cuda", dtype=torch.bfloat16) / h ** 0.5,
              torch.randn(d, device="cuda", dtype=torch.bfloat16)]
    leaves = [t.requires_grad_() for t in leaves]

    def block(x, w1, b1, w2, b2):
        return F.linear(fn_act(F.linear(x, w1, b1)), w2, b2) + x

    with collect() as graphs:
        out = torch.compile(block, backend="xaccel")(*leaves)
        cot = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, cot)
    backward = [r.pattern for r in Report(graphs=graphs).replacements if "backward" in r.note]
    assert sorted(backward) == sorted(["mm -> add(full)", f"mm -> {grad_op}(full)"])
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_grads = torch.autograd.grad(block(*ref_leaves), ref_leaves, cot.double())
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 5e-2
