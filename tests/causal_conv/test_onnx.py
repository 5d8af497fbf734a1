"""ONNX export of the causal_conv family: the xlstm package's CausalConv1d form, with and without
bias, becomes one `xaccel` node whose body (the reference, exported by torch.onnx) a stock
onnxruntime runs, equal to PyTorch within 1e-5 (fp32) at two batch sizes and two sequence lengths
from one export."""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import onnx_checked_in_a_fresh_process, onnxruntime_outputs, rel_err

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
xonnx = pytest.importorskip("torch_xaccel.onnx")


class CausalConv(torch.nn.Module):
    def __init__(self, C=12, K=4, bias=True):
        super().__init__()
        self.conv = torch.nn.Conv1d(C, C, K, padding=K - 1, groups=C, bias=bias)
        self.K = K

    def forward(self, x):
        y = self.conv(x.transpose(1, 2))[..., :-(self.K - 1)]
        return F.silu(y.transpose(1, 2))


@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv_exports_as_one_node_and_matches(tmp_path, bias):
    torch.manual_seed(0)
    model = CausalConv(bias=bias).eval()
    path = tmp_path / "causal_conv.onnx"
    dyn = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},)
    res = xonnx.export(model, (torch.randn(3, 9, 12),), path, dynamic_shapes=dyn, report=False)
    assert res.xaccel_nodes == {"causal_conv1d": 1}
    onnx_checked_in_a_fresh_process(path)
    for B, S in ((2, 5), (5, 17)):
        x = torch.randn(B, S, 12)
        with torch.no_grad():
            want = model(x)
        (got,) = onnxruntime_outputs(path, x)
        assert got.shape == want.shape and rel_err(got, want) <= 1e-5
