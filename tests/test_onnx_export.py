"""torch_xaccel.onnx.export beyond one family: what has no ONNX body yet exports as standard ONNX
and the report says so; an xaccel op without a body is a clear error; XACCEL_DISABLE exports the
model as written."""
import pytest
import torch

from tests.helpers import (
    inferred_shapes_match_onnxruntime,
    onnxruntime_outputs,
    rel_err,
    xaccel_nodes_fit_their_schemas,
)

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
xonnx = pytest.importorskip("torch_xaccel.onnx")


def test_a_pattern_without_a_body_exports_as_standard_onnx_and_is_reported(tmp_path, monkeypatch):
    """A family whose ops have no ONNX body (simulated: the mLSTM's taken away) stays out of the
    export's passes: the demo's mLSTM block exports as standard ONNX, equal to PyTorch."""
    import dataclasses

    from torch_xaccel import families
    from torch_xaccel.demo import MLSTMBlock

    monkeypatch.setattr(families, "FAMILIES", tuple(dataclasses.replace(f, onnx={}) if f.name == "mlstm" else f
                                                    for f in families.FAMILIES))
    torch.manual_seed(0)
    block, x = MLSTMBlock(32).eval(), torch.randn(2, 6, 32)
    res = xonnx.export(block, (x,), tmp_path / "mlstm.onnx", report=False)
    assert "mlstm" not in res.xaccel_nodes
    assert any(f.family == "mlstm" and "no ONNX body yet" in f.reason for f in res.report.fallbacks)
    with torch.no_grad():
        want = block(x)
    assert rel_err(onnxruntime_outputs(tmp_path / "mlstm.onnx", x)[0], want) <= 1e-5


def test_an_xaccel_op_without_a_body_is_a_clear_error():
    class Direct(torch.nn.Module):
        def forward(self, q, k, v, i, f):
            return torch.ops.xaccel.mlstm_with_chunk_states(q, k, v, i, f, None, None, None, 1e-6, 64)[0]

    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"xaccel::mlstm_with_chunk_states .*has no ONNX body yet; the ops with one: "
                                         r"gemm_epilogue, headwise, mlstm, mlstm_step, slstm, slstm_step"):
        xonnx.export(Direct(), (q, q, q, torch.randn(1, 2, 8), torch.randn(1, 2, 8)), report=False)


def test_disabled_exports_the_model_as_written(tmp_path, monkeypatch):
    from torch_xaccel.demo import SLSTMBlock

    monkeypatch.setenv("XACCEL_DISABLE", "1")
    torch.manual_seed(0)
    block, x = SLSTMBlock(16).eval(), torch.randn(1, 4, 16)
    res = xonnx.export(block, (x,), tmp_path / "b.onnx", report=False)
    assert res.xaccel_nodes == {} and not res.model.functions
    with torch.no_grad():
        want = block(x)
    assert rel_err(onnxruntime_outputs(tmp_path / "b.onnx", x)[0], want) <= 1e-5
    assert "xaccel nodes none" in str(res)


def test_the_demo_model_has_one_node_per_fused_region_of_the_compile(tmp_path):
    """Every region the compile fuses is one xaccel node of the export (same counts per op);
    onnxruntime equals PyTorch; the nodes fit their schemas, whose shape inference gives every
    xaccel output the static shape onnxruntime returns."""
    import torch_xaccel
    from torch_xaccel.demo import DemoModel

    torch.manual_seed(0)
    model, tokens = DemoModel().eval(), torch.randint(0, 101, (2, 16))
    res = xonnx.export(model, (tokens,), tmp_path / "demo.onnx", report=False)
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(tokens)
        torch.compile(model, backend="xaccel")(tokens)
    compiled = torch_xaccel.last_report(1).counts()
    assert res.xaccel_nodes == {k: n for k, n in compiled.items() if n}
    assert compiled["gemm_epilogue"] > 0 and compiled["mlstm"] == 2 and compiled["slstm"] == 2
    assert rel_err(onnxruntime_outputs(tmp_path / "demo.onnx", tokens)[0], want) <= 1e-5
    xaccel_nodes_fit_their_schemas(res.model)
    assert inferred_shapes_match_onnxruntime(res.model, tokens) == 0


def test_a_failing_pass_exports_the_model_as_written_with_the_reason(tmp_path, monkeypatch):
    import sys

    from torch_xaccel.demo import GeluMLP

    export_module = sys.modules["torch_xaccel.onnx.export"]  # (the package's `export` is the function)

    def broken(ep, cfg, report):
        raise RuntimeError("injected")
    monkeypatch.setattr(export_module, "_lower", broken)
    torch.manual_seed(0)
    mlp, x = GeluMLP(16, 32).eval(), torch.randn(2, 3, 16)
    res = xonnx.export(mlp, (x,), tmp_path / "m.onnx", report=False)
    assert res.xaccel_nodes == {}
    assert any("RuntimeError: injected; exported the model as written" in f.reason for f in res.report.fallbacks)
    with torch.no_grad():
        assert rel_err(onnxruntime_outputs(tmp_path / "m.onnx", x)[0], mlp(x)) <= 1e-5
