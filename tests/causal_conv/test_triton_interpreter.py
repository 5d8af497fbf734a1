"""The generated causal_conv kernels, run by Triton's interpreter on the CPU (fp32 and fp16),
against the reference in float64: the forward, the input gradient and the weight and bias
gradients, at kernel sizes 2-5, position counts that do not fill a tile or a weight-gradient
chunk, channel counts that do not fill a tile, and x with channels or positions innermost or
sliced from wider rows (read in place)."""
import textwrap

import pytest

from tests.helpers import interpret

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from torch_xaccel.codegen.causal_conv import triton_kernels as k
    from torch_xaccel.ops.causal_conv import reference
    torch.manual_seed(0)
    bad = 0
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 2e-3)):
        for B, C, S, K, layout, bias in ((2, 70, 37, 4, "channels", True), (1, 5, 300, 2, "positions", False),
                                         (3, 130, 65, 5, "sliced", True), (1, 3, 1, 3, "channels", True)):
            if layout == "channels":
                x = torch.randn(B, S, C).transpose(1, 2)
            elif layout == "positions":
                x = torch.randn(B, C, S)
            else:
                x = torch.randn(B, S, 2 * C)[..., :C].transpose(1, 2)
            x = x.to(dtype)  # (a cast keeps a dense view's layout; the sliced one becomes channels innermost)
            w, b = torch.randn(C, K).to(dtype), (torch.randn(C).to(dtype) if bias else None)
            dy = torch.randn(B, S, C).transpose(1, 2).to(dtype)
            want = reference.forward(x.double(), w.double(), None if b is None else b.double())
            got = k.forward(None, x, w, b)
            dx, dw, db = k.backward(None, dy, x, w, bias)
            wdx, wdw, wdb = reference.backward(dy.double(), x.double(), w.double(), bias)
            errs = [rel(got, want), rel(dx, wdx), rel(dw, wdw)] + ([rel(db, wdb)] if bias else [])
            layout_ok = got.stride() == reference.channels_last_like(x).stride() and dx.stride() == got.stride()
            bad += not layout_ok or got.dtype != dtype or not all(e <= tol for e in errs) or (db is None) == bias
            print(dtype, B, C, S, K, layout, bias, " ".join(f"{e:.1e}" for e in errs))
    raise SystemExit(bad)
""")


def test_causal_conv_kernels_match_reference_in_interpreter(tmp_path):
    out = interpret(SCRIPT, tmp_path)
    assert out.count("\n") == 8, out


COMPILED_SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from torch_xaccel.codegen import causal_conv as kernels
    from torch_xaccel.report import Report, collect
    calls = []
    for name in ("forward", "backward"):
        fn = getattr(kernels, name)
        setattr(kernels, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    def layer(x, w, b):  # the xlstm package's CausalConv1d, then its activation
        K = w.shape[-1]
        y = F.conv1d(x.transpose(1, 2), w, b, padding=K - 1, groups=w.shape[0])[..., :-(K - 1)]
        return F.silu(y.transpose(1, 2))
    torch.manual_seed(0)
    x, w, b = (torch.randn(*s, requires_grad=True) for s in ((2, 37, 20), (20, 1, 4), (20,)))
    dy = torch.randn(2, 37, 20)
    want = layer(x, w, b)
    want_grads = torch.autograd.grad(want, (x, w, b), dy)
    with collect() as graphs:
        got = torch.compile(layer, backend="xaccel")(x, w, b)
        grads = torch.autograd.grad(got, (x, w, b), dy)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    print(Report(graphs).counts()["causal_conv"], sorted(set(calls)), rel(got, want),
          max(rel(g, r) for g, r in zip(grads, want_grads)))
""")


def test_compiled_layer_runs_the_kernels_forward_and_backward_in_interpreter(tmp_path):
    """A compiled CausalConv1d layer calls the kernels (forward and backward) through the provider,
    equal to eager within 1e-5 in fp32."""
    found, calls_fwd, calls_bwd, fwd, grad = interpret(COMPILED_SCRIPT, tmp_path).replace("[", "").replace(
        "]", "").replace(",", "").replace("'", "").split()
    assert int(found) == 1 and (calls_fwd, calls_bwd) == ("backward", "forward"), (calls_fwd, calls_bwd)
    assert float(fwd) <= 1e-5 and float(grad) <= 1e-5, (fwd, grad)
