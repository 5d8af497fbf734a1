"""Whole-graph give-ups and cache faults a fuzzer and fault injection found: each must compile,
or repair itself, and match eager."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_xaccel
from tests.helpers import check_compiled


def test_dynamic_shapes_with_a_layer_norm_fuse_and_stay_dynamic():
    """dynamic=True makes LayerNorm's eps a graph input read with .item(); the ATen trace cannot
    pass that to layer_norm. The backend has Dynamo specialize the float and trace again: the
    chain fuses, and one compile still serves two batch sizes."""
    torch.manual_seed(0)
    norm, lin = nn.LayerNorm(16), nn.Linear(16, 32)

    def block(x):
        return F.gelu(lin(norm(x))) * 2

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="xaccel", dynamic=True)
    for batch in (3, 5):
        x = torch.randn(batch, 16)
        torch.testing.assert_close(compiled(x), block(x))
    report = torch_xaccel.last_report()
    assert report.counts()["gemm_epilogue"] == 1 and len(report.graphs) == 1, str(report)
    assert not [f for f in report.fallbacks if f.family == "backend"], str(report)


def test_a_float64_scalar_operand_in_grad_mode_fuses():
    """A 0-d float64 tensor multiplying the chain makes aot_autograd restart Dynamo's analysis
    (TensorifyScalarRestartAnalysis): Dynamo's own control flow, let through, not reported as a
    backend failure."""
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    s = torch.tensor(2.0, dtype=torch.float64)
    report = check_compiled(lambda x, w, s: torch.relu(x @ w.t()) * s, (x, w, s))
    assert report.counts()["gemm_epilogue"] == 1, str(report)
    assert not [f for f in report.fallbacks if f.family == "backend"], str(report)


def test_a_cached_kernel_source_that_is_not_utf8_is_rewritten(tmp_path, monkeypatch):
    """kernels/<name>.py holding binary garbage (a disk fault) is written anew and imported."""
    from torch_xaccel.codegen import cache

    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path))
    path = tmp_path / "kernels" / "xaccel_fault_probe.py"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\xff\xfe\x00garbage\x80")
    mod = cache.load_source("xaccel_fault_probe", "VALUE = 42\n")
    assert mod.VALUE == 42 and path.read_text() == "VALUE = 42\n"
