"""The generated group_norm kernels, run by Triton's interpreter on the CPU (fp32 and fp16),
against the reference in float64: forward and backward with and without weight and bias, group
widths that are not powers of two, row counts that do not fill a tile or a backward chunk, and x
given as a strided view (read in place)."""
import textwrap

import pytest

from tests.helpers import interpret

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from torch_xaccel.codegen.group_norm import triton_kernels as k
    from torch_xaccel.ops.group_norm import reference
    torch.manual_seed(0)
    bad = 0
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for N, C, G, affine, sliced in ((37, 96, 4, "both", False), (130, 48, 1, "weight", True),
                                        (5, 30, 3, "none", False), (70, 64, 8, "both", True)):
            x = torch.randn(N, 2 * C)[:, :C] if sliced else torch.randn(N, C) * 3 + 1
            x = x.to(dtype)
            w = torch.randn(C).to(dtype) if affine != "none" else None
            b = torch.randn(C).to(dtype) if affine == "both" else None
            dy = torch.randn(N, C).to(dtype)
            d = lambda t: None if t is None else t.double()  # noqa: E731
            want = reference.forward(x.double(), d(w), d(b), G, 1e-5)
            got = k.forward(None, x, w, b, G, 1e-5)
            dx, dw, db = k.backward(None, dy, x, w, G, 1e-5, b is not None)
            wdx, wdw, wdb = reference.backward(dy.double(), x.double(), d(w), G, 1e-5, b is not None)
            errs = [rel(got, want), rel(dx, wdx)] + ([rel(dw, wdw)] if w is not None else []) + \\
                   ([rel(db, wdb)] if b is not None else [])
            bad += got.dtype != dtype or not all(e <= tol for e in errs) or (dw is None) != (w is None) \\
                or (db is None) != (b is None)
            print(dtype, N, C, G, affine, sliced, " ".join(f"{e:.1e}" for e in errs))
    raise SystemExit(bad)
""")


def test_group_norm_kernels_match_reference_in_interpreter(tmp_path):
    out = interpret(SCRIPT, tmp_path)
    assert out.count("\n") == 8, out
