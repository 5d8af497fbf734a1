"""ONNX export of the headwise family: the xlstm package's LinearHeadwiseExpand form becomes one
`xaccel` node whose body (the reference, exported by torch.onnx) a stock onnxruntime runs, equal
to PyTorch within 1e-5 (fp32) at two batch sizes and two sequence lengths from one export."""
import pytest
import torch

from tests.helpers import onnx_checked_in_a_fresh_process, onnxruntime_outputs, rel_err

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
xonnx = pytest.importorskip("torch_xaccel.onnx")


class Projection(torch.nn.Module):
    def __init__(self, H=8, D=4, DO=4):
        super().__init__()
        self.H = H
        self.w = torch.nn.Parameter(torch.randn(H, DO, D))
        self.b = torch.nn.Parameter(torch.randn(H * DO))

    def forward(self, x):
        y = torch.einsum("...hd,hod->...ho", x.view(*x.shape[:-1], self.H, -1), self.w)
        return y.reshape(*x.shape[:-1], -1) + self.b


def test_projection_exports_as_one_node_and_matches(tmp_path):
    torch.manual_seed(0)
    model = Projection().eval()
    path = tmp_path / "headwise.onnx"
    dyn = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},)
    res = xonnx.export(model, (torch.randn(3, 7, 32),), path, dynamic_shapes=dyn, report=False)
    assert res.xaccel_nodes == {"headwise": 1}
    onnx_checked_in_a_fresh_process(path)
    for B, S in ((2, 5), (5, 11)):
        x = torch.randn(B, S, 32)
        with torch.no_grad():
            want = model(x)
        (got,) = onnxruntime_outputs(path, x)
        assert got.shape == want.shape and rel_err(got, want) <= 1e-5
