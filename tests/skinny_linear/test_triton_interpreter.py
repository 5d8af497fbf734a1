"""The generated skinny_linear kernels, run by Triton's interpreter on the CPU (fp32 and fp16),
against the reference in float64: one to three inputs (widths that do not fill a column tile),
with and without a bias, row counts that do not fill a tile or a backward chunk, 3-D inputs and
a strided view read in place; the backward with addends on some inputs' gradients."""
import textwrap

import pytest

from tests.helpers import interpret

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from torch_xaccel.codegen.skinny_linear import triton_kernels as k
    from torch_xaccel.ops.skinny_linear import reference
    torch.manual_seed(0)
    bad = 0
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for lead, widths, N, bias, sliced in (((37,), (96, 40, 100), 8, True, False),
                                              ((2, 45), (33,), 3, False, True),
                                              ((600,), (64, 64), 16, True, False)):
            xs = [(torch.randn(*lead, 2 * w)[..., :w] if sliced else torch.randn(*lead, w)).to(dtype) for w in widths]
            w = (torch.randn(N, sum(widths)) / 8).to(dtype)
            b = torch.randn(N).to(dtype) if bias else None
            dy = torch.randn(*lead, N).to(dtype)
            got = k.forward(None, w, b, xs)
            want = reference.forward(w.double(), None if b is None else b.double(), [x.double() for x in xs])
            grads = k.backward(None, dy, w, xs, bias)
            wants = reference.backward(dy.double(), w.double(), [x.double() for x in xs], bias)
            adds = [None if j == 1 else torch.randn(*lead, 2 * x.shape[-1])[..., ::2].to(dtype)
                    for j, x in enumerate(xs)]
            summed = k.backward(None, dy, w, xs, bias, adds)[:len(xs)]
            want_summed = reference.backward(dy.double(), w.double(), [x.double() for x in xs], bias,
                                             [None if a is None else a.double() for a in adds])[:len(xs)]
            errs = [rel(got, want)] + [rel(g, r) for g, r in zip(grads, wants) if r.numel()] + [
                rel(g, r) for g, r in zip(summed, want_summed)]
            bad += got.dtype != dtype or got.shape != want.shape or not all(e <= tol for e in errs) \\
                or any(g.shape != r.shape for g, r in zip(grads, wants))
            print(dtype, lead, widths, N, bias, " ".join(f"{e:.1e}" for e in errs))
    raise SystemExit(bad)
""")


def test_skinny_linear_kernels_match_reference_in_interpreter(tmp_path):
    out = interpret(SCRIPT, tmp_path)
    assert out.count("\n") == 6, out
