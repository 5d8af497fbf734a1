"""CUDA: the causal_conv kernels against the fp64 reference in bf16 and fp16 (the 7:1 stack's
convolution, 1536 channels of kernel size 4 over S1024, the activation transposed as the xlstm
package hands it over, and odd sizes), the op end to end with its backward, and the xlstm block
stack compiled with both convolutions replaced, equal to eager."""
import pytest
import torch

from tests.causal_conv import xlstm_stack
from tests.helpers import rel_err
from torch_xaccel.ops.causal_conv import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,C,S,K,layout", [(16, 1536, 1024, 4, "channels"), (3, 77, 333, 3, "positions"),
                                            (2, 130, 1000, 2, "sliced")])
def test_kernels_match_reference(dtype, B, C, S, K, layout):
    from torch_xaccel.codegen.causal_conv import triton_kernels as k

    torch.manual_seed(C + K)
    if layout == "channels":
        x = torch.randn(B, S, C, device="cuda", dtype=dtype).transpose(1, 2)
    elif layout == "positions":
        x = torch.randn(B, C, S, device="cuda", dtype=dtype)
    else:
        x = torch.randn(B, S, 2 * C, device="cuda", dtype=dtype)[..., :C].transpose(1, 2)
    w, b = torch.randn(C, K, device="cuda").to(dtype), torch.randn(C, device="cuda").to(dtype)
    dy = torch.randn(B, S, C, device="cuda", dtype=dtype).transpose(1, 2)
    got = k.forward(None, x, w, b)
    assert got is not NotImplemented and got.dtype == dtype and got.stride() == reference.channels_last_like(x).stride()
    assert rel_err(got, reference.forward(x.double(), w.double(), b.double())) <= 1e-2
    dx, dw, db = k.backward(None, dy, x, w, True)
    want = reference.backward(dy.double(), x.double(), w.double(), True)
    assert rel_err(dx, want[0]) <= 1e-2 and rel_err(dw, want[1]) <= 1e-3 and rel_err(db, want[2]) <= 1e-3


def test_xlstm_block_stack_compiled_on_cuda_replaces_both_convolutions():
    pytest.importorskip("xlstm")
    from torch_xaccel.report import last_report

    torch.manual_seed(0)
    model = xlstm_stack(128, 128).cuda()
    x = torch.randn(2, 128, 128, device="cuda")
    want = model(x)
    got = torch.compile(model, backend="xaccel")(x)
    assert last_report().counts()["causal_conv"] == 2, str(last_report())
    assert rel_err(got, want) <= 1e-3  # fp32 through every family's CUDA kernels (mLSTM, GEMM chains too)
