"""ONNX export of GEMM + elementwise chains: each xaccel.gemm_epilogue is one `xaccel` node whose
FunctionProto is reference.forward exported for the node's ranks and dtype (its epilogue program
an attribute), run by a stock onnxruntime at other batch and sequence sizes, equal to PyTorch
within 1e-5 (fp32); the node count equals the compile's."""
import pytest
import torch
import torch.nn.functional as F

import torch_xaccel
from tests.helpers import onnx_checked_in_a_fresh_process, onnxruntime_outputs, rel_err

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
xonnx = pytest.importorskip("torch_xaccel.onnx")


class TwoOutputs(torch.nn.Module):
    """A chain whose intermediate is also returned (the op's extra output) and a scaled residual."""

    def __init__(self, d=32, hidden=64):
        super().__init__()
        self.up = torch.nn.Linear(d, hidden)

    def forward(self, x, res):
        pre = self.up(x)
        return F.gelu(pre, approximate="tanh") * 0.5 + res, pre


def _models():
    from torch_xaccel.demo import GeluMLP, SwiGLU

    torch.manual_seed(0)
    return {"gelu_mlp": (GeluMLP(32, 128).eval(), 1), "swiglu": (SwiGLU(32, 96).eval(), 1),
            "extra_output": (TwoOutputs().eval(), 2)}


@pytest.mark.parametrize("name", ["gelu_mlp", "swiglu", "extra_output"])
def test_chains_export_as_one_node_each_and_match_at_other_sizes(tmp_path, name):
    model, n_in = _models()[name]
    make = (lambda B, S: (torch.randn(B, S, 32),)) if n_in == 1 else \
        (lambda B, S: (torch.randn(B, S, 32), torch.randn(B, S, 64)))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    path = tmp_path / f"{name}.onnx"
    res = xonnx.export(model, make(2, 5), path, dynamic_shapes=({0: batch, 1: seq},) * n_in, report=False)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="xaccel")(*make(2, 5))
    assert res.xaccel_nodes == {"gemm_epilogue": torch_xaccel.last_report(1).counts()["gemm_epilogue"]} != {}
    onnx_checked_in_a_fresh_process(path)
    for B, S in ((3, 4), (1, 9)):
        inputs = make(B, S)
        with torch.no_grad():
            want = model(*inputs)
        want = want if isinstance(want, tuple) else (want,)
        got = onnxruntime_outputs(path, *inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and rel_err(g, w) <= 1e-5, (B, S, rel_err(g, w))
