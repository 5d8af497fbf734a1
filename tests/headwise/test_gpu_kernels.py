"""CUDA: the headwise kernels against the fp64 reference in bf16 and fp16 (the 7:1 stack's
projection class, 384 heads of 4 x 4, and odd blocks and row counts), the op end to end with its
backward, and a compiled projection equal to eager."""
import pytest
import torch

from tests.helpers import rel_err
from torch_xaccel.ops.headwise import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead,H,D,DO", [((4, 1000), 384, 4, 4), ((777,), 6, 3, 5), ((3, 129), 10, 16, 16)])
def test_kernels_match_reference(dtype, lead, H, D, DO):
    from torch_xaccel.codegen.headwise import triton_kernels as k

    torch.manual_seed(H + D)
    x = torch.randn(*lead, H, 2 * D, device="cuda")[..., :D].to(dtype)  # a strided view
    w = torch.randn(H, DO, D, device="cuda").to(dtype)
    dy = torch.randn(*lead, H, DO, device="cuda").to(dtype)
    got = k.kernel_forward(x, w)
    assert got is not NotImplemented and got.dtype == dtype
    assert rel_err(got, reference.forward(x.double(), w.double())) <= 1e-2
    dx_want = reference.forward(dy.double(), w.double().transpose(1, 2))
    assert rel_err(k.kernel_forward(dy, w.transpose(1, 2)), dx_want) <= 1e-2
    assert rel_err(k.weight_grad(None, dy, x), reference.weight_grad(dy.double(), x.double())) <= 1e-2


def test_op_forward_and_gradients_through_kernels():
    torch.manual_seed(0)
    x = torch.randn(16, 257, 384, 4, device="cuda").bfloat16().requires_grad_()
    w = torch.randn(384, 4, 4, device="cuda").bfloat16().requires_grad_()
    y = torch.ops.xaccel.headwise(x, w)
    dy = torch.randn_like(y)
    y.backward(dy)
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    want = reference.forward(xd, wd)
    want.backward(dy.double())
    assert rel_err(y, want) <= 1e-2
    assert rel_err(x.grad, xd.grad) <= 5e-2 and rel_err(w.grad, wd.grad) <= 5e-2
    assert w.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16


def test_compiled_projection_equals_eager():
    from torch_xaccel.report import Report, collect

    torch.manual_seed(1)
    w = torch.randn(96, 4, 4, device="cuda", requires_grad=True)
    x = torch.randn(3, 50, 384, device="cuda", requires_grad=True)

    def f(x, w):
        return torch.einsum("...hd,hod->...ho", x.view(3, 50, 96, 4), w).reshape(3, 50, -1)
    want = f(x, w)
    gx, gw = torch.autograd.grad(want.square().sum(), (x, w))
    torch._dynamo.reset()
    with collect() as graphs:
        got = torch.compile(f, backend="xaccel")(x, w)
        hx, hw = torch.autograd.grad(got.square().sum(), (x, w))
    assert Report(graphs).counts()["headwise"] == 1
    assert rel_err(got, want) <= 1e-5 and rel_err(hx, gx) <= 1e-5 and rel_err(hw, gw) <= 1e-5


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_size_call_plainly_and_in_a_cuda_graph(batch):
    """A decode-size projection called plainly takes whichever of kernel and reference costs less
    per call (tuning.PlainCalls); inside a CUDA-graph capture the kernel runs. Both agree with the
    reference."""
    from tests.helpers import plain_and_captured
    from torch_xaccel.codegen.headwise import triton_kernels as k

    torch.manual_seed(batch)
    w = torch.randn(384, 4, 4, device="cuda").bfloat16()

    def make_inputs():
        return (torch.randn(batch, 1, 384, 4, device="cuda").bfloat16(),)
    results, captured_kernels = plain_and_captured(lambda x: torch.ops.xaccel.headwise(x, w), make_inputs, k,
                                                   "kernel_forward")
    for (x,), y in results:
        assert rel_err(y, reference.forward(x.double(), w.double())) <= 1e-2
    assert captured_kernels == 1
