"""Models over protobuf's 2 GB limit: torch_xaccel.onnx.export writes the weights to a `.data`
file beside the model (ONNX external data), the xaccel nodes and their function bodies in the
model file; a stock onnxruntime loads it from the path and equals PyTorch on fresh random inputs.
ExportResult.save(path, external_data=None|True|False) writes it again, anywhere."""
import os

import pytest
import torch

from tests.helpers import onnx_checked_in_a_fresh_process, onnxruntime_outputs, rel_err

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
xonnx = pytest.importorskip("torch_xaccel.onnx")
export_module = pytest.importorskip("torch_xaccel.onnx.export")  # (the package's `export` is the function)


class TableAndMLP(torch.nn.Module):
    """An embedding table (the weights' bulk, cheap to run) and a GeLU MLP (two xaccel nodes)."""

    def __init__(self, rows: int, dim: int):
        from torch_xaccel.demo import GeluMLP

        super().__init__()
        self.table = torch.nn.Embedding(rows, dim, _weight=torch.empty(rows, dim).uniform_(-1, 1))
        self.mlp = GeluMLP(dim, 2 * dim)

    def forward(self, ids):
        return self.mlp(self.table(ids))


def _saved_parts(path):
    """(the model file without its weights, the tensors it keeps in external data)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    external = [t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    return proto, external


def _dims():
    return ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},)


def test_a_model_over_the_limit_writes_external_data_by_itself(tmp_path, monkeypatch):
    """The limit lowered to 64 KB (the real one: the next test): a 100 KB model is written with
    its weights in model.onnx.data; the bodies stay in model.onnx; onnx's full checker (in a
    process with no xaccel schema) and onnxruntime read it from the path."""
    monkeypatch.setattr(export_module, "EXTERNAL_DATA_THRESHOLD", 64 * 1024)
    torch.manual_seed(0)
    model = TableAndMLP(256, 64).eval()  # 64 KB of table, 33 KB of MLP
    path = tmp_path / "model.onnx"
    res = xonnx.export(model, (torch.randint(0, 256, (2, 5)),), path, dynamic_shapes=_dims(), report=False)
    assert res.xaccel_nodes == {"gemm_epilogue": 2}
    assert res.data_path == str(tmp_path / "model.onnx.data") and os.path.exists(res.data_path)
    assert "(weights in model.onnx.data)" in str(res)
    proto, external = _saved_parts(path)
    assert "table.weight" in external and os.path.getsize(path) < 64 * 1024
    assert sorted(f.name for f in proto.functions) == ["gemm_epilogue", "gemm_epilogue"]
    assert all(f.domain == "xaccel" for f in proto.functions)
    assert {n.overload for n in proto.graph.node if n.domain == "xaccel"} == {f.overload for f in proto.functions}
    onnx_checked_in_a_fresh_process(path)
    for B, S in ((3, 4), (1, 9)):
        ids = torch.randint(0, 256, (B, S))
        with torch.no_grad():
            assert rel_err(onnxruntime_outputs(path, ids)[0], model(ids)) <= 1e-5


def test_save_writes_one_file_or_external_data_as_asked(tmp_path, monkeypatch):
    """save(): None picks by size, True always writes external data, False never does (over the
    limit it is a ValueError that says what to pass); every file gives PyTorch's output."""
    torch.manual_seed(1)
    model, ids = TableAndMLP(64, 32).eval(), torch.randint(0, 64, (2, 3))
    res = xonnx.export(model, (ids,), report=False)  # nothing written yet
    assert res.path is None and res.data_path is None and res.xaccel_nodes == {"gemm_epilogue": 2}
    res.save(tmp_path / "one.onnx")
    assert res.path == str(tmp_path / "one.onnx") and res.data_path is None
    assert not _saved_parts(tmp_path / "one.onnx")[1] and not (tmp_path / "one.onnx.data").exists()
    res.save(tmp_path / "two.onnx", external_data=True)
    assert res.data_path == str(tmp_path / "two.onnx.data") and "table.weight" in _saved_parts(tmp_path / "two.onnx")[1]
    monkeypatch.setattr(export_module, "EXTERNAL_DATA_THRESHOLD", 1024)
    with pytest.raises(ValueError, match=r"over protobuf's 2 GB limit .*external_data=True \(or None\)"):
        res.save(tmp_path / "three.onnx", external_data=False)
    res.save(tmp_path / "three.onnx")
    assert res.data_path == str(tmp_path / "three.onnx.data")
    with torch.no_grad():
        want = model(ids)
    for name in ("one", "two", "three"):
        assert rel_err(onnxruntime_outputs(tmp_path / f"{name}.onnx", ids)[0], want) <= 1e-5, name
    assert {f.name for f in res.model.functions} == {"gemm_epilogue"}  # the ModelProto: the weights inside


def test_a_model_just_over_2_gib_exports_and_runs_in_onnxruntime(tmp_path):
    """The real limit: a table of 2 GiB + 1 MiB (fp32) and an MLP. The weights go to
    big.onnx.data; onnxruntime loads big.onnx from its path and equals PyTorch on fresh random
    ids at other sizes. Traced without Dynamo (strict=False): Dynamo's export keeps a copy of
    every weight it meets (torch's real-value cache); the file does not depend on the tracer. The
    files are removed at the end (pytest keeps its last temporary folders)."""
    import onnx

    dim = 64
    rows = (2**31 + 2**20) // (4 * dim)
    torch.manual_seed(2)
    model = TableAndMLP(rows, dim).eval()
    path = tmp_path / "big.onnx"
    try:
        res = xonnx.export(model, (torch.randint(0, rows, (2, 5)),), path, dynamic_shapes=_dims(), strict=False,
                           report=False)
        assert res.xaccel_nodes == {"gemm_epilogue": 2}
        assert res.data_path == str(tmp_path / "big.onnx.data")
        assert os.path.getsize(res.data_path) > 2**31 and os.path.getsize(path) < 2**20
        proto, external = _saved_parts(path)
        assert "table.weight" in external
        assert [f.domain for f in proto.functions] == ["xaccel", "xaccel"]
        assert {o.domain for o in proto.opset_import} >= {"", "xaccel"}
        onnx.checker.check_model(str(path))  # (a path: the checker's way for a model over 2 GB)
        for B, S in ((3, 4), (1, 7)):
            ids = torch.randint(0, rows, (B, S))
            with torch.no_grad():
                want = model(ids)
            (got,) = onnxruntime_outputs(path, ids)
            assert got.shape == want.shape and rel_err(got, want) <= 1e-5
    finally:
        for f in (path, tmp_path / "big.onnx.data"):
            if f.exists():
                f.unlink()
