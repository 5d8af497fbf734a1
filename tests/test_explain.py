"""torch_xaccel.explain: counts per family, fallbacks with reasons, graph breaks, a readable table."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_xaccel


class WithBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = F.gelu(self.a(x)) * 0.5
        print("graph break here")  # Dynamo cannot capture print
        return self.b(h)


def test_explain_counts_fallbacks_breaks_and_table(capsys):
    report = torch_xaccel.explain(WithBreak(), torch.randn(4, 8))
    assert report.counts() == {"gemm_epilogue": 1, "mlstm": 0, "mlstm_step": 0, "headwise": 0, "causal_conv": 0,
                               "group_norm": 0, "skinny_linear": 0, "slstm": 0,
                               "slstm_step": 0, "pointwise": 0}
    assert len(report.graphs) == 2 and len(report.graph_breaks) == 1
    kinds = {f.family for f in report.fallbacks}
    assert "graph_break" in kinds and "gemm_epilogue" in kinds  # the second linear: nothing to fuse
    text = str(report)
    assert "gemm_epilogue=1" in text and "1 graph break(s)" in text
    assert "test_explain.py:15 in forward" in text  # the table points at the user's source line
    assert "nothing to fuse" in text


def test_explain_does_not_change_results_of_later_compiles():
    model = WithBreak()
    x = torch.randn(3, 8)
    torch_xaccel.explain(model, x)
    torch.testing.assert_close(torch.compile(model, backend="xaccel")(x), model(x))


def _many_pointwise(x, w):
    y = F.gelu(F.linear(x, w))
    for _ in range(6):
        y = torch.sin(y) * 1.1 + 0.1  # sin stops the epilogue: 18 pointwise ops stay outside
    return y


def _few_pointwise(x, w):
    return torch.tanh(F.linear(x, w)) + 1


def test_report_suggests_inductor_for_many_eager_pointwise_ops(xaccel_env):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.no_grad():
        torch.compile(_many_pointwise, backend="xaccel")(x, w)
    text = str(torch_xaccel.last_report(1))
    assert "18 pointwise ops" in text and "XACCEL_FALLBACK=inductor" in text
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(_few_pointwise, backend="xaccel")(x, w)
    assert "hint" not in str(torch_xaccel.last_report(1))
    torch._dynamo.reset()
    xaccel_env(XACCEL_FALLBACK="inductor")
    with torch.no_grad():
        torch.compile(_many_pointwise, backend="xaccel")(x, w)
    assert "hint" not in str(torch_xaccel.last_report(1))


def test_explain_names_the_kernel_each_gemm_case_runs(monkeypatch, tmp_path):
    """The tuner's decision for every GEMM case the run used, in words, with pending CUTLASS builds.
    The tuning itself is stubbed (ATen wins, two CUTLASS configs building): the plumbing is tested."""
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets the GEMM provider take CPU tensors
    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm_kernels, "_DECISIONS", {})
    monkeypatch.setattr(gemm_kernels, "_PENDING", {})
    monkeypatch.setattr(gemm_kernels, "choose", lambda case, *a: (None, [], ""))
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"))
    report = torch_xaccel.explain(model, torch.randn(4, 8))
    assert report.kernel_choices == [("gemm_epilogue", "float32 M4 N16 K8: add(row) -> gelu_tanh",
                                      "ATen (cuBLAS, then the chain)")]
    assert "  kernel    gemm_epilogue  float32 M4 N16 K8: add(row) -> gelu_tanh -> ATen" in str(report)
    assert gemm_kernels.describe(("cutlass_pp", 128, 128, 64, 2, 1, 8, 0), 2) == (
        "CUTLASS ping-pong 128x128x64, cluster 2x1; 2 CUTLASS configs still building (timed again once built)")
    assert gemm_kernels.describe(("tma", 128, 256, 64, 8, 8, 3, 1)) == "Triton tma 128x256x64"


def test_last_report_forgets_graphs_from_before_a_dynamo_reset():
    """torch._dynamo.reset() drops every compiled graph: last_report() then reports none of
    them, and a compile after the reset counts alone."""
    fn = lambda x, w: torch.relu(x @ w) * 2  # noqa: E731
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    torch.compile(fn, backend="xaccel")(x, w)
    assert torch_xaccel.last_report().counts()["gemm_epilogue"] == 1
    torch._dynamo.reset()
    assert torch_xaccel.last_report().graphs == []
    torch.compile(fn, backend="xaccel")(x, w)
    assert torch_xaccel.last_report().counts()["gemm_epilogue"] == 1


def test_where_names_the_module_when_the_model_is_an_nn_sequential():
    """A model that is itself an nn.Sequential leaves no user frame in the stack traces: the
    report's "where" names the module each match ran in, not an FX node name."""
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 8), nn.ReLU()))
    report = torch_xaccel.explain(model, torch.randn(4, 8))
    assert [r.location for r in report.replacements] == ["Sequential.0 (Linear)", "Sequential.2.0 (Linear)"]


def test_report_hints_at_a_cuda_graph_for_decode_steps_called_plainly():
    """A graph with decode-step ops on CUDA, compiled without CUDA graphs, gets the hint (its
    token is host-bound); with CUDA graphs (mode="reduce-overhead"), on the CPU, or without step
    ops, none. Fake CUDA values: no GPU needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_xaccel.backend import plain_decode_steps
    from torch_xaccel.modes import CUDAGRAPHS
    from torch_xaccel.report import GraphReport, Replacement, Report

    with FakeTensorMode():
        on_gpu, on_cpu = [torch.empty(1, 8, device="cuda")], [torch.empty(1, 8)]
    graph = GraphReport(0, replacements=[Replacement("mlstm", "xaccel.mlstm_step", "recurrent step"),
                                         Replacement("slstm", "xaccel.slstm_step", "one step"),
                                         Replacement("headwise", "xaccel.headwise", "per-head map")])
    assert plain_decode_steps(graph, on_gpu, {}) == 2
    assert plain_decode_steps(graph, on_gpu, {CUDAGRAPHS: True}) == 0 and plain_decode_steps(graph, on_cpu, {}) == 0
    prefill = GraphReport(0, replacements=[Replacement("mlstm", "xaccel.mlstm", "parallel form")])
    assert plain_decode_steps(prefill, on_gpu, {}) == 0
    graph.plain_decode_steps = 2
    assert "hint: 2 decode-step op(s) run on CUDA outside a CUDA graph" in str(Report(graphs=[graph]))
    assert "decode-step" not in str(Report(graphs=[prefill]))
