"""CUDA: the skinny_linear kernels against the fp64 reference in bf16, fp16 and fp32 (the 7:1
stack's mLSTM gates: 16384 rows of q, k, v of 1536 each into 8 outputs; and odd sizes), forward
and backward; a decode-size call runs the reference."""
import pytest
import torch

from tests.helpers import rel_err
from torch_xaccel.ops.skinny_linear import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lead,widths,N,bias", [((16, 1024), (1536, 1536, 1536), 8, True),
                                                 ((3001,), (100, 7), 5, False), ((2, 777), (4096,), 16, True)])
def test_kernels_match_reference(dtype, lead, widths, N, bias):
    from torch_xaccel.codegen.skinny_linear import triton_kernels as k

    torch.manual_seed(N + len(widths))
    xs = [torch.randn(*lead, w, device="cuda").to(dtype) for w in widths]
    w = (torch.randn(N, sum(widths), device="cuda") / 16).to(dtype)
    b = torch.randn(N, device="cuda").to(dtype) if bias else None
    dy = torch.randn(*lead, N, device="cuda").to(dtype)
    d = [x.double() for x in xs]
    got = k.forward(None, w, b, xs)
    assert got is not NotImplemented and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert rel_err(got, reference.forward(w.double(), None if b is None else b.double(), d)) <= tol
    grads = k.backward(None, dy, w, xs, bias)
    wants = reference.backward(dy.double(), w.double(), d, bias)
    for g, r in zip(grads, wants):
        assert g.shape == r.shape and (not r.numel() or rel_err(g, r) <= tol)


def test_decode_sizes_run_the_reference():
    from torch_xaccel.codegen.skinny_linear import triton_kernels as k

    xs = [torch.randn(8, 1536, device="cuda", dtype=torch.bfloat16)]
    assert k.forward(None, torch.randn(8, 1536, device="cuda", dtype=torch.bfloat16), None, xs) is NotImplemented
