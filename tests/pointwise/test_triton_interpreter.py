"""The generated pointwise kernel, run by Triton's interpreter on the CPU (fp32 and fp16), against
the op's reference in float64: inputs broadcast along leading, inner and all dims (a 0-d tensor),
an input read transposed, constants, several outputs and outputs with transposed strides, shapes
that do not fill a tile."""
import textwrap

import pytest

from tests.helpers import interpret

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from torch_xaccel.codegen.pointwise import triton_kernels as k
    from torch_xaccel.ops.pointwise import reference
    from torch_xaccel.ops.pointwise.op import case_key
    from torch_xaccel.ops.pointwise.program import Program
    torch.manual_seed(0)
    L = lambda j: {"op": "load", "operand": j, "bcast": "full"}  # noqa: E731
    # v5 = silu(x * y) ; v7 = v5 + 0.5 * z ; v8 = gelu_tanh(v7) ; v9 = silu_grad(v8, x) ; outputs v9, v5, v7
    nodes = (L(0), L(1), L(2), {"op": "mul", "in": [0, 1]}, {"op": "const", "value": 0.5},
             {"op": "silu", "in": [3]}, {"op": "mul", "in": [4, 2]}, {"op": "add", "in": [5, 6]},
             {"op": "gelu_tanh", "in": [7]}, {"op": "silu_grad", "in": [8, 0]})
    bad = 0
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 1e-3)):
        for shape, y_shape, z_kind, out_order in (
                ((3, 50, 70), (70,), "full", (0, 1, 2)),       # a bias-like row, dense outputs
                ((2, 33, 130), (33, 1), "transposed", (0, 1, 2)),  # a column, an input read transposed
                ((5, 17, 9), (), "full", (0, 2, 1)),            # a 0-d input, outputs laid out transposed
                ((4096 * 3 + 7,), (1,), "full", (0,))):         # one long dim, a broadcast size-1 dim
            x = torch.randn(shape).to(dtype)
            y = torch.randn(y_shape).to(dtype)
            z = torch.randn(shape).to(dtype) if z_kind == "full" else \\
                torch.randn(shape[:-2] + (shape[-1], shape[-2])).to(dtype).transpose(-1, -2)
            dense = torch.empty(shape).permute(out_order).contiguous().permute(
                [out_order.index(d) for d in range(len(shape))])
            strides = (tuple(dense.stride()),) * 2 + (tuple(torch.empty(shape).stride()),)
            p = Program(nodes, (9, 5, 7), tuple(shape), strides, str(dtype).removeprefix("torch."))
            got = k.forward(case_key([x, y, z], p.to_json()), [x, y, z], p.to_json())
            want = reference.forward([x.double(), y.double(), z.double()], p)
            errs = [rel(g, w.double()) for g, w in zip(got, want)]
            bad += not all(e <= tol for e in errs) or any(
                g.stride() != s or g.dtype != dtype for g, s in zip(got, strides))
            print(dtype, shape, y_shape, z_kind, out_order, " ".join(f"{e:.1e}" for e in errs))
    raise SystemExit(bad)
""")


def test_pointwise_kernel_matches_reference_in_interpreter(tmp_path):
    out = interpret(SCRIPT, tmp_path)
    assert out.count("\n") == 8, out
