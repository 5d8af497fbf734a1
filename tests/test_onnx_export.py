"""torch_xaccel.onnx.export beyond one family: what has no ONNX body yet exports as standard ONNX
and the report says so; an xaccel op without a body is a clear error; XACCEL_DISABLE exports the
model as written; other opsets, one below 18 a clear error; fp16 and bf16 files."""
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
            return torch.ops.xaccel.mlstm_saving(q, k, v, i, f, None, None, None, 1e-6, 64)[0]

    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"xaccel::mlstm_saving .*has no ONNX body yet; the ops with one: "
                                         r"causal_conv1d, gemm_epilogue, group_norm, headwise, mlstm, mlstm_step, "
                                         r"skinny_linear, slstm, slstm_step"):
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
    """Every region the compile fuses is one xaccel node of the export, its batch dim symbolic
    (same counts per op); onnxruntime equals PyTorch at two batch sizes; the nodes fit their
    schemas, whose shape inference gives every xaccel output the shape onnxruntime returns."""
    import torch_xaccel
    from torch_xaccel.demo import DemoModel

    torch.manual_seed(0)
    model, tokens = DemoModel().eval(), torch.randint(0, 101, (2, 16))
    res = xonnx.export(model, (tokens,), tmp_path / "demo.onnx", dynamic_shapes=({0: torch.export.Dim("batch")},),
                       report=False)
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(tokens)
        torch.compile(model, backend="xaccel")(tokens)
    compiled = torch_xaccel.last_report(1).counts()
    assert res.xaccel_nodes == {k: n for k, n in compiled.items() if n}
    assert compiled["gemm_epilogue"] > 0 and compiled["mlstm"] == 2 and compiled["slstm"] == 2
    assert rel_err(onnxruntime_outputs(tmp_path / "demo.onnx", tokens)[0], want) <= 1e-5
    other = torch.randint(0, 101, (5, 16))  # the batch dim is symbolic: one export serves other sizes
    with torch.no_grad():
        assert rel_err(onnxruntime_outputs(tmp_path / "demo.onnx", other)[0], model(other)) <= 1e-5
    xaccel_nodes_fit_their_schemas(res.model)
    assert inferred_shapes_match_onnxruntime(res.model, tokens) > 0  # the batch dims, by the input's dim name


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


class ThreeFamilies(torch.nn.Module):
    """A GEMM chain, an mLSTM and a headwise projection, each one xaccel node."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.w = torch.nn.Parameter(torch.randn(8, 4, 4))

    def forward(self, x):
        y = self.l2(torch.nn.functional.gelu(self.l1(x)))
        B, S, _ = x.shape
        q = y.view(B, S, 2, 16).transpose(1, 2)
        i, f = y[..., :2].transpose(1, 2), y[..., 2:4].transpose(1, 2) + 2
        h = torch.ops.xaccel.mlstm(q, q, q, i, f, None, None, None, 1e-6, 16)[0]
        z = torch.einsum("...hd,hod->...ho", h.transpose(1, 2).reshape(B, S, 8, 4), self.w)
        return z.reshape(B, S, 32) + y


@pytest.mark.parametrize("opset", [18, 21, 23])
def test_other_opsets_export_and_match(tmp_path, opset):
    """The model and every body at the requested opset; the full checker in a fresh process and
    onnxruntime pass, equal to PyTorch."""
    from tests.helpers import onnx_checked_in_a_fresh_process

    torch.manual_seed(opset)
    model, x = ThreeFamilies().eval(), torch.randn(2, 20, 32)
    path = tmp_path / f"opset{opset}.onnx"
    res = xonnx.export(model, (x,), path, opset_version=opset, report=False)
    assert res.xaccel_nodes == {"gemm_epilogue": 1, "mlstm": 1, "headwise": 1}
    assert {o.domain: o.version for o in res.model.opset_import}[""] == opset
    assert all({o.domain: o.version for o in fn.opset_import}.get("", opset) == opset for fn in res.model.functions)
    onnx_checked_in_a_fresh_process(path)
    with torch.no_grad():
        assert rel_err(onnxruntime_outputs(path, x)[0], model(x)) <= 1e-5


def test_an_opset_below_the_exporters_is_a_clear_error():
    with pytest.raises(ValueError, match="opset_version 17 is not supported"):
        xonnx.export(ThreeFamilies().eval(), (torch.randn(1, 4, 32),), opset_version=17, report=False)


def test_fp16_export_runs_in_onnxruntime_and_bf16_passes_the_checker(tmp_path):
    """fp16: onnxruntime's output within 1e-2 of the fp32 model with the same (rounded) weights
    (the bodies compute the recurrence in fp32, as the reference does). bf16: a valid file (the
    full checker); onnxruntime's CPU provider has no bf16 kernels for standard ops such as Add, so
    it is not run here."""
    import onnx

    torch.manual_seed(1)
    model = ThreeFamilies().eval().half()
    ref = ThreeFamilies().eval()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    x = torch.randn(2, 20, 32).half()
    res = xonnx.export(model, (x,), tmp_path / "fp16.onnx", report=False)
    assert res.xaccel_nodes == {"gemm_epilogue": 1, "mlstm": 1, "headwise": 1}
    (got,) = onnxruntime_outputs(tmp_path / "fp16.onnx", x)
    with torch.no_grad():
        assert got.dtype == torch.float16 and rel_err(got.float(), ref(x.float())) <= 1e-2
    res = xonnx.export(model.bfloat16(), (x.bfloat16(),), tmp_path / "bf16.onnx", report=False)
    assert res.xaccel_nodes == {"gemm_epilogue": 1, "mlstm": 1, "headwise": 1}
    onnx.checker.check_model(res.model, full_check=True)


def test_an_export_prints_nothing_warns_nothing_and_logs_its_report(tmp_path, capfd, recwarn, caplog):
    """With default settings: nothing on stdout or stderr (torch's LeafSpec FutureWarning and the
    exporter's torchvision notes filtered where torch raises them), no warning; the report is an
    INFO record of the `torch_xaccel.onnx` logger (TORCH_LOGS / logging show it)."""
    import logging

    from torch_xaccel.demo import GeluMLP

    torch.manual_seed(0)
    mlp, x = GeluMLP(16, 32).eval(), torch.randn(2, 3, 16)
    with caplog.at_level(logging.INFO, logger="torch_xaccel.onnx"):
        res = xonnx.export(mlp, (x,), tmp_path / "m.onnx")
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert [str(w.message) for w in recwarn] == []
    logged = [r for r in caplog.records if r.name == "torch_xaccel.onnx"]
    assert [r.levelno for r in logged] == [logging.INFO] and logged[0].getMessage() == str(res)
    assert "xaccel nodes gemm_epilogue=2" in str(res)
    caplog.clear()
    xonnx.export(mlp, (x,), report=False)
    assert not [r for r in caplog.records if r.name == "torch_xaccel.onnx"]
