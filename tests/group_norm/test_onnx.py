"""ONNX export of the group_norm family: a per-head layer norm of rows becomes one `xaccel` node
whose body (the reference, exported by torch.onnx) a stock onnxruntime runs, equal to PyTorch
within 1e-5 (fp32) at two batch sizes and two sequence lengths from one export."""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import onnx_checked_in_a_fresh_process, onnxruntime_outputs, rel_err

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
xonnx = pytest.importorskip("torch_xaccel.onnx")


class HeadNorm(torch.nn.Module):
    def __init__(self, heads=4, width=8, bias=True):
        super().__init__()
        self.heads = heads
        self.weight = torch.nn.Parameter(torch.randn(heads * width))
        self.bias = torch.nn.Parameter(torch.randn(heads * width)) if bias else None

    def forward(self, x):  # x [B, S, heads * width]
        B, S, C = x.shape
        return F.group_norm(x.reshape(B * S, C), self.heads, self.weight, self.bias).view(B, S, C)


@pytest.mark.parametrize("bias", [True, False])
def test_head_norm_exports_as_one_node_and_matches(tmp_path, bias):
    torch.manual_seed(0)
    model = HeadNorm(bias=bias).eval()
    path = tmp_path / "group_norm.onnx"
    dyn = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},)
    res = xonnx.export(model, (torch.randn(3, 9, 32),), path, dynamic_shapes=dyn, report=False)
    assert res.xaccel_nodes == {"group_norm": 1}
    onnx_checked_in_a_fresh_process(path)
    for B, S in ((2, 5), (5, 17)):
        x = torch.randn(B, S, 32)
        with torch.no_grad():
            want = model(x)
        (got,) = onnxruntime_outputs(path, x)
        assert got.shape == want.shape and rel_err(got, want) <= 1e-5
