"""The pointwise rest pass on graphs (Triton's interpreter stands in for a GPU: the pass fuses only
where kernels run): what forms a group, what stays out (small tensors, other dtypes, values written
in place, a group that could not run as one call), the outputs' strides, and a whole model's
forward and backward graphs against eager."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_xaccel.lowering.pointwise import groups
from torch_xaccel.report import GraphReport

N = groups.MIN_ELEMENTS


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (read when the pass asks; the kernels run in subprocesses)


def _fused(fn, *args):
    """(graph after the pass, its report, the graph's result, eager's result)."""
    gm = make_fx(fn)(*args)
    report = GraphReport(index=0)
    groups.run(gm, report, "test")
    with torch.no_grad(), pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "0")  # the fused calls run their reference here (the kernels: subprocesses)
        return gm, report, gm(*args), fn(*args)


def _ops(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_gated_activation_is_one_call_with_the_values_read_outside_as_outputs():
    def f(h, a, z, skip):
        mixed = h + skip * a
        out = mixed * torch.nn.functional.silu(z)
        return out @ torch.ones(64, 8), mixed  # mixed is read outside the group (a saved value)
    args = [torch.randn(N // 64, 64) for _ in range(3)] + [torch.randn(64)]
    gm, report, got, want = _fused(f, *args)
    assert _ops(gm).count(torch.ops.xaccel.pointwise.default) == 1
    assert [r.family for r in report.replacements] == ["pointwise"]
    assert "4 elementwise ops" in report.replacements[0].pattern and report.replacements[0].note == "test"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_small_tensors_other_dtypes_and_lone_ops_stay_as_written():
    def f(x, y, z):
        small = torch.sigmoid(x[:8] * 2.0) + 1.0  # 8 rows: below MIN_ELEMENTS
        mixed = (y.double() * 2.0).float()  # a cast in between: not an elementwise op of the table
        lone = z + 1.0  # one op: nothing to fuse
        return small, mixed, lone
    gm, report, got, want = _fused(f, *(torch.randn(N // 16, 16) for _ in range(3)))
    assert torch.ops.xaccel.pointwise.default not in _ops(gm) and not report.replacements
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_value_written_in_place_is_not_fused():
    def f(x, y):
        t = x * y
        t.add_(1.0)  # (a pre-dispatch graph keeps in-place ops)
        return torch.tanh(t) * 2.0
    gm, report, got, want = _fused(f, torch.randn(N), torch.randn(N))
    assert torch.ops.aten.mul.Tensor in _ops(gm) and torch.ops.aten.add_.Tensor in _ops(gm)  # t as written
    assert [r.pattern.split(": ")[1].split(" (")[0] for r in report.replacements] == ["tanh -> mul"]
    torch.testing.assert_close(got, want)


def test_a_group_that_cannot_run_as_one_call_is_split():
    """t feeds a matmul whose result feeds the group again: one call for both would need the
    matmul's result before t exists, so the ops after the matmul form their own group."""
    def f(x, w):
        t = torch.sigmoid(x) * x
        back = t @ w
        return torch.tanh(back + t) * 3.0
    gm, report, got, want = _fused(f, torch.randn(N // 64, 64), torch.randn(64, 64))
    assert _ops(gm).count(torch.ops.xaccel.pointwise.default) == 2
    gm.graph.lint()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_group_the_kernel_cannot_walk_stays_as_written_and_is_reported():
    def f(x, y):
        return torch.sigmoid(x * y) + 1.0
    x = torch.randn(8, 8, 32, 32)  # N elements
    y = torch.randn(32, 32, 8, 8).permute(3, 2, 1, 0)  # strides reversed: no two dims merge for both
    gm, report, got, want = _fused(f, x, y)
    assert torch.ops.xaccel.pointwise.default not in _ops(gm) and not report.replacements
    assert [fb.family for fb in report.fallbacks] == ["pointwise"]
    assert "laid out differently" in report.fallbacks[0].reason
    torch.testing.assert_close(got, want)
    # the same group over inputs of one layout fuses
    gm, report, got, want = _fused(f, x, y.contiguous())
    assert _ops(gm).count(torch.ops.xaccel.pointwise.default) == 1 and not report.fallbacks


def test_outputs_keep_the_strides_the_graph_has():
    def f(x, y):
        return torch.sigmoid(x.t() * 2.0) + y  # eager lays the result out as x.t() (transposed)
    x, y = torch.randn(N // 32, 32), torch.randn(32, N // 32)
    gm, report, got, want = _fused(f, x, y)
    assert report.replacements and got.stride() == want.stride() and not got.is_contiguous()
    torch.testing.assert_close(got, want)


MODEL = textwrap.dedent("""
    import torch
    from torch_xaccel.report import last_report
    from xlstm import (mLSTMBlockConfig, mLSTMLayerConfig, sLSTMBlockConfig, sLSTMLayerConfig, xLSTMBlockStack,
                       xLSTMBlockStackConfig)
    from torch_xaccel.lowering.pointwise import groups
    groups.MIN_ELEMENTS = 1 << 12  # small shapes (the interpreter's cost) still form groups
    E, B, S = 128, 2, 32
    cfg = xLSTMBlockStackConfig(
        mlstm_block=mLSTMBlockConfig(mlstm=mLSTMLayerConfig(conv1d_kernel_size=4, qkv_proj_blocksize=4, num_heads=4)),
        slstm_block=sLSTMBlockConfig(slstm=sLSTMLayerConfig(backend="vanilla", num_heads=4, conv1d_kernel_size=4,
                                                            batch_size=B)),
        context_length=S, num_blocks=2, embedding_dim=E, slstm_at=[1])
    torch.manual_seed(0)
    model = xLSTMBlockStack(cfg)
    x, w = torch.randn(B, S, E), torch.randn(B, S, E)  # w: a cotangent (a square loss cancels
    want = model(x)                                  # through the final LayerNorm)
    (want * w).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = torch.compile(model, backend="xaccel")(x)
    (got * w).sum().backward()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    notes = sorted({r.note for r in last_report().replacements if r.family == "pointwise"})
    worst = max(rel(p.grad, g) for p, g in zip(model.parameters(), grads) if g.norm() > 0)
    print(notes, rel(got, want), worst)
    from torch_xaccel.codegen.pointwise import triton_kernels
    assert bool(triton_kernels._PLANS) == bool(notes), "the fused groups ran their reference, not the kernel"
    assert notes == ["backward", "forward"] and rel(got, want) < 1e-6
""")


def test_the_xlstm_stack_runs_fused_groups_in_its_forward_and_backward(tmp_path):
    pytest.importorskip("xlstm")
    from torch_xaccel import families

    env = {k: v for k, v in os.environ.items() if k != "XACCEL_PATTERNS"}
    env.update(TRITON_INTERPRET="1", XACCEL_CACHE_DIR=str(tmp_path))  # the default patterns: pointwise among them
    proc = subprocess.run([sys.executable, "-c", MODEL], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    notes, fwd, worst = proc.stdout.strip().splitlines()[-1].rsplit(" ", 2)
    # the gradients against eager: as without the pass (the interpreter's mLSTM kernels in fp32);
    # without the pass they come out the same
    without_pass = dict(env, XACCEL_PATTERNS=",".join(p for p in families.PATTERNS if p != "pointwise"))
    without = subprocess.run([sys.executable, "-c", MODEL.replace('["backward", "forward"]', "[]")], env=without_pass,
                             capture_output=True, text=True, timeout=900)
    assert without.returncode == 0, without.stdout + without.stderr[-3000:]
    assert abs(float(worst) - float(without.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])) < 1e-6
