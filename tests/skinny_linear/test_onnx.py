"""ONNX export of the skinny_linear family: gate projections over a concatenation become one
`xaccel` node whose body (the reference, exported by torch.onnx) a stock onnxruntime runs, equal
to PyTorch within 1e-5 (fp32) at two batch sizes and two sequence lengths from one export."""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import onnx_checked_in_a_fresh_process, onnxruntime_outputs, rel_err

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
xonnx = pytest.importorskip("torch_xaccel.onnx")


class Gates(torch.nn.Module):
    def __init__(self, width=8, heads=4, bias=True):
        super().__init__()
        self.igate = torch.nn.Linear(3 * width, heads, bias=bias)
        self.fgate = torch.nn.Linear(3 * width, heads, bias=bias)

    def forward(self, q, k, v):
        x = torch.cat([q, k, v], -1)
        return self.igate(x).exp() + F.logsigmoid(self.fgate(x))


@pytest.mark.parametrize("bias", [True, False])
def test_gates_export_as_one_node_and_match(tmp_path, bias):
    torch.manual_seed(0)
    model = Gates(bias=bias).eval()
    path = tmp_path / "skinny_linear.onnx"
    dim = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
    res = xonnx.export(model, tuple(torch.randn(3, 9, 8) for _ in range(3)), path,
                       dynamic_shapes=(dim, dim, dim), report=False)
    assert res.xaccel_nodes == {"skinny_linear": 1}
    onnx_checked_in_a_fresh_process(path)
    for B, S in ((2, 5), (5, 17)):
        inputs = [torch.randn(B, S, 8) for _ in range(3)]
        with torch.no_grad():
            want = model(*inputs)
        (got,) = onnxruntime_outputs(path, *inputs)
        assert got.shape == want.shape and rel_err(got, want) <= 1e-5
