"""Never fail a compile because of xaccel; never let a broken kernel give a wrong answer."""
import pytest
import torch
import torch.nn.functional as F

import torch_xaccel
from torch_xaccel import runtime
from torch_xaccel.lowering.gemm_epilogue import chains
from torch_xaccel.report import Report, collect


def fn(x, w):
    return torch.tanh(F.linear(x, w)) + 1


def test_exception_in_a_pass_falls_back_with_one_warning(monkeypatch):
    def broken(gm, ctx):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(chains, "run", broken)
    x, w = torch.randn(5, 3), torch.randn(4, 3)
    with pytest.warns(torch_xaccel.XaccelFallbackWarning, match="planted failure") as record, collect() as graphs:
        out = torch.compile(fn, backend="xaccel")(x, w)
    assert len([r for r in record if issubclass(r.category, torch_xaccel.XaccelFallbackWarning)]) == 1
    torch.testing.assert_close(out, fn(x, w))
    report = Report(graphs=graphs)
    assert report.counts()["gemm_epilogue"] == 0
    assert any(f.family == "backend" and "planted failure" in f.reason for f in report.fallbacks)


def test_exception_after_lowering_also_falls_back(monkeypatch):
    import torch_xaccel.backend as backend

    def broken(*a):
        raise ValueError("aot exploded")

    monkeypatch.setattr(backend, "_compile_rest", broken)
    x, w = torch.randn(5, 3), torch.randn(4, 3)
    with pytest.warns(torch_xaccel.XaccelFallbackWarning, match="aot exploded"):
        out = torch.compile(fn, backend="xaccel")(x, w)
    torch.testing.assert_close(out, fn(x, w))


def test_failing_kernel_provider_degrades_to_reference():
    calls = []

    def broken_provider(key, *args):
        calls.append(key)
        raise RuntimeError("kernel build failed")

    runtime.register_provider("gemm_epilogue", broken_provider)
    try:
        x, w = torch.randn(5, 3), torch.randn(4, 3)
        compiled = torch.compile(fn, backend="xaccel")
        with pytest.warns(torch_xaccel.XaccelFallbackWarning, match="kernel build failed"):
            out = compiled(x, w)
        torch.testing.assert_close(out, fn(x, w))
        out2 = compiled(x, w)  # the broken provider is not retried for the same case
        torch.testing.assert_close(out2, fn(x, w))
        assert len(calls) == 1
        assert runtime.EVENTS[-1].reason == "RuntimeError: kernel build failed"
    finally:
        runtime.unregister_provider("gemm_epilogue", broken_provider)


def test_a_kernel_broken_at_one_fp32_precision_still_runs_at_another():
    """fp32 kernels build differently per torch.get_float32_matmul_precision() (TF32 or 3xTF32):
    a failure at "high" keeps the kernel out at "high" only."""
    calls = []

    def provider(key, *args):
        calls.append(torch.get_float32_matmul_precision())
        if calls[-1] == "high":
            raise RuntimeError("no TF32 build")
        return NotImplemented

    before = torch.get_float32_matmul_precision()
    runtime.register_provider("gemm_epilogue", provider)
    try:
        compiled = torch.compile(fn, backend="xaccel")
        x, w = torch.randn(5, 3), torch.randn(4, 3)
        torch.set_float32_matmul_precision("high")
        with pytest.warns(torch_xaccel.XaccelFallbackWarning, match="no TF32 build"):
            torch.testing.assert_close(compiled(x, w), fn(x, w))
        compiled(x, w)
        torch.set_float32_matmul_precision("highest")
        torch.testing.assert_close(compiled(x, w), fn(x, w))
        assert calls == ["high", "highest"]
    finally:
        torch.set_float32_matmul_precision(before)
        runtime.unregister_provider("gemm_epilogue", provider)


def test_provider_result_is_used_when_it_takes_the_case():
    seen = []

    def provider(key, a, bs, operands, epilogue, b_transposed):
        seen.append(key)
        return NotImplemented if a.shape[0] == 5 else [torch.full((a.shape[0], bs[0].shape[0]), 7.0)]

    runtime.register_provider("gemm_epilogue", provider)
    try:
        compiled = torch.compile(fn, backend="xaccel", dynamic=True)
        x, w = torch.randn(5, 3), torch.randn(4, 3)
        torch.testing.assert_close(compiled(x, w), fn(x, w))  # NotImplemented -> reference
        assert torch.all(compiled(torch.randn(6, 3), w) == 7.0)  # the provider's own result
        assert seen[0][:4] == ("cpu", torch.float32, True, torch.Size([5, 3]))
    finally:
        runtime.unregister_provider("gemm_epilogue", provider)


def test_explain_reports_a_failing_kernel():
    def broken_provider(key, *args):
        raise RuntimeError("no kernel today")

    runtime.register_provider("gemm_epilogue", broken_provider)
    try:
        with pytest.warns(torch_xaccel.XaccelFallbackWarning):
            report = torch_xaccel.explain(fn, torch.randn(6, 3), torch.randn(7, 3))
    finally:
        runtime.unregister_provider("gemm_epilogue", broken_provider)
    assert report.counts()["gemm_epilogue"] == 1
    assert any("no kernel today" in e.reason for e in report.runtime_fallbacks)
    assert "no kernel today" in str(report)


def test_inference_runs_the_lowered_graph_without_a_second_trace(monkeypatch):
    """With grad mode off the lowered ATen graph runs as it is (aot_autograd would only trace it
    again); with grad mode on it goes through aot_autograd, even when no input needs grad, and
    both match eager."""
    import torch._dynamo.backends.common as common

    traced = []
    real = common.aot_autograd

    def counting(**kw):
        traced.append(1)
        return real(**kw)
    monkeypatch.setattr(common, "aot_autograd", counting)
    x, w = torch.randn(5, 3), torch.randn(4, 3, requires_grad=True)
    with torch.no_grad(), collect() as graphs:
        out = torch.compile(fn, backend="xaccel")(x, w)
    torch.testing.assert_close(out, fn(x, w))
    assert Report(graphs=graphs).counts()["gemm_epilogue"] == 1 and not traced
    torch._dynamo.reset()
    torch.compile(fn, backend="xaccel")(x, w.detach())  # grad mode on, nothing needs grad
    assert traced
    torch._dynamo.reset()
    out = torch.compile(fn, backend="xaccel")(x, w)
    out.sum().backward()
    got, w.grad = w.grad, None
    fn(x, w).sum().backward()
    assert traced
    torch.testing.assert_close(out, fn(x, w))
    torch.testing.assert_close(got, w.grad)


def test_a_family_provider_takes_an_op_whose_tensors_come_as_a_list(monkeypatch):
    """xaccel::pointwise passes its inputs as one list: the provider must still see a tensor that
    kernels can run on (else every call runs the reference, silently slower)."""
    provider = runtime._Provider(path="torch_xaccel.codegen.pointwise:forward")
    x = torch.randn(4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert provider.takes(([x, x], "program")) and provider.takes((x, "program"))
    assert not provider.takes(([], "program"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not provider.takes(([x], "program"))  # a CPU tensor outside the interpreter: the reference
