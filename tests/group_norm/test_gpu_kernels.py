"""CUDA: the group_norm kernels against the fp64 reference in bf16 and fp16 (the 7:1 stack's head
norm, 16384 rows of 4 heads of 384, and odd sizes), forward and backward."""
import pytest
import torch

from tests.helpers import rel_err
from torch_xaccel.ops.group_norm import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,C,G,affine", [(16384, 1536, 4, "weight"), (1000, 96, 3, "both"), (77, 4096, 1, "none")])
def test_kernels_match_reference(dtype, N, C, G, affine):
    from torch_xaccel.codegen.group_norm import triton_kernels as k

    torch.manual_seed(C + G)
    x = (torch.randn(N, C, device="cuda") * 2 + 0.5).to(dtype)
    w = torch.randn(C, device="cuda").to(dtype) if affine != "none" else None
    b = torch.randn(C, device="cuda").to(dtype) if affine == "both" else None
    dy = torch.randn(N, C, device="cuda").to(dtype)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    got = k.kernel_forward(x, w, b, G, 1e-5)
    assert got is not NotImplemented and got.dtype == dtype
    assert rel_err(got, reference.forward(x.double(), d(w), d(b), G, 1e-5)) <= 1e-2
    dx, dw, db = k.backward(None, dy, x, w, G, 1e-5, b is not None)
    want = reference.backward(dy.double(), x.double(), d(w), G, 1e-5, b is not None)
    assert rel_err(dx, want[0]) <= 1e-2
    assert w is None or rel_err(dw, want[1]) <= 1e-3
    assert b is None or rel_err(db, want[2]) <= 1e-3


@pytest.mark.parametrize("rows", [1, 8])
def test_decode_size_call_plainly_and_in_a_cuda_graph(rows):
    """A decode-size head norm called plainly takes whichever of kernel and reference costs less
    per call (tuning.PlainCalls); inside a CUDA-graph capture the kernel runs. Both agree with the
    reference."""
    from tests.helpers import plain_and_captured
    from torch_xaccel.codegen.group_norm import triton_kernels as k

    torch.manual_seed(rows)
    w = torch.randn(1536, device="cuda").bfloat16()

    def make_inputs():
        return ((torch.randn(rows, 1536, device="cuda") * 2 + 0.5).bfloat16(),)
    results, captured_kernels = plain_and_captured(lambda x: torch.ops.xaccel.group_norm(x, w, None, 4, 1e-5),
                                                   make_inputs, k, "kernel_forward")
    for (x,), y in results:
        assert rel_err(y, reference.forward(x.double(), w.double(), None, 4, 1e-5)) <= 1e-2
    assert captured_kernels == 1
