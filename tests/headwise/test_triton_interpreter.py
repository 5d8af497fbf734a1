"""The generated headwise kernels, run by Triton's interpreter on the CPU (fp32 and fp16), against
the reference in float64: the forward, the input gradient (the forward with w transposed per head,
a strided view) and the weight gradient, at block sizes that are not powers of two, row counts
that do not fill a tile or a weight-gradient chunk, and x given as a strided view or with its
positions innermost (read in place); the forward with an addend given as a transposed view."""
import textwrap

import pytest

from tests.helpers import interpret

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from torch_xaccel.codegen.headwise import triton_kernels as k
    from torch_xaccel.ops.headwise import reference
    torch.manual_seed(0)
    bad = 0
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 2e-3)):
        for lead, H, D, DO, layout in (((2, 37), 6, 4, 4, "sliced"), ((300,), 5, 3, 7, "sliced"),
                                       ((1, 3), 130, 1, 16, "sliced"), ((2, 259), 3, 16, 2, "sliced"),
                                       ((2, 3, 133), 20, 4, 4, "transposed"), ((150,), 7, 5, 3, "transposed")):
            if layout == "sliced":  # a strided view, read in place
                x = torch.randn(*lead, H, 2 * D)[..., :D].to(dtype)
            else:  # positions innermost, as a convolution's output seen as [..., S, H, D]
                n = len(lead)
                x = torch.randn(*lead[:-1], H, D, lead[-1]).permute(*range(n - 1), n + 1, n - 1, n).to(dtype)
            w = torch.randn(H, DO, D).to(dtype)
            dy = torch.randn(*lead, H, DO).to(dtype)
            want = reference.forward(x.double(), w.double())
            got = k.forward(None, x, w)
            dx = k.forward(None, dy, w.transpose(1, 2))
            dw = k.weight_grad(None, dy, x)
            addend = torch.randn(*lead, DO, H).to(dtype).transpose(-1, -2)  # any strides
            summed = k.forward(None, x, w, addend)
            errs = [rel(got, want), rel(dx, reference.forward(dy.double(), w.double().transpose(1, 2))),
                    rel(dw, reference.weight_grad(dy.double(), x.double())),
                    rel(summed, reference.forward(x.double(), w.double(), addend.double()))]
            shapes_ok = got.shape == want.shape and got.dtype == dtype and dw.shape == w.shape and dx.shape == x.shape
            bad += not shapes_ok or not all(e <= tol for e in errs)
            print(dtype, lead, H, D, DO, layout, " ".join(f"{e:.1e}" for e in errs))
    raise SystemExit(bad)
""")


def test_headwise_kernels_match_reference_in_interpreter(tmp_path):
    out = interpret(SCRIPT, tmp_path)
    assert out.count("\n") == 12, out
