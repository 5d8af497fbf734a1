"""torch_xaccel.onnx.translation_table(): a module whose own code calls torch.ops.xaccel.* exports
through plain torch.onnx.export(dynamo=True, custom_translation_table=...), each call its op's
body (the same one torch_xaccel.onnx.export attaches), and a stock onnxruntime equals PyTorch on
fresh random inputs at other sizes."""
import pytest
import torch

from tests.helpers import onnxruntime_outputs, rel_err
from torch_xaccel import families

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
xonnx = pytest.importorskip("torch_xaccel.onnx")

# bias add then tanh GeLU after the GEMM (the epilogue program the gemm_epilogue pass writes for
# GeluMLP's first layer; a Tensor[] return: one output per program output)
GELU = ('{"nodes":[{"index":0,"op":"acc"},{"bcast":"row","op":"load","operand":0},{"in":[0,1],"op":"add"},'
        '{"in":[2],"op":"gelu_tanh"}],"outputs":[3],"v":1}')


class CallsTheOps(torch.nn.Module):
    """A rewritten model: a fused GEMM + GeLU, a per-head norm without bias, an mLSTM."""

    def __init__(self, d=16, hidden=32, heads=4):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(torch.randn(hidden, d) / 4), torch.nn.Parameter(torch.randn(hidden))
        self.norm_weight, self.heads = torch.nn.Parameter(torch.randn(hidden)), heads

    def forward(self, x, q, i, f):
        y = torch.ops.xaccel.gemm_epilogue(x, [self.w], [self.b], GELU, True)[0]
        B, S, C = y.shape
        y = torch.ops.xaccel.group_norm(y.reshape(B * S, C), self.norm_weight, None, self.heads, 1e-5)
        h = torch.ops.xaccel.mlstm(q, q, q, i, f, None, None, None, 1e-6, 16)[0]
        return y.view(B, S, C), h


def _inputs(B, S):
    return torch.randn(B, S, 16), torch.randn(B, 2, 16, 8), torch.randn(B, 2, 16), torch.randn(B, 2, 16) + 2


def test_the_table_has_every_op_with_a_body():
    from torch_xaccel.onnx import functions

    table = xonnx.translation_table()
    assert list(table) == functions.translatable_ops()
    assert all(callable(fn) for fn in table.values())
    # every op a family gives an ONNX body (families.py), each under its own translation
    assert set(table) == {getattr(torch.ops.xaccel, name).default for f in families.FAMILIES for name in f.onnx}
    assert all(fn.__name__ == f"xaccel_{op._schema.name.split('::')[1]}_translation" for op, fn in table.items())


# raised by the caller's own torch.onnx.export, outside any translation: torch's to filter, not ours
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:# The axis name.*will not be used:UserWarning")
def test_plain_torch_onnx_export_of_a_module_calling_the_ops_matches_eager(tmp_path):
    """torch.onnx converts the model to its opset after translating, inlining every function:
    the file holds the bodies as standard ONNX, with no xaccel node left and no plugin needed."""
    import onnx

    torch.manual_seed(0)
    model = CallsTheOps().eval()
    batch = torch.export.Dim("batch")
    program = torch.onnx.export(model, _inputs(2, 5), dynamo=True, verbose=False,
                                dynamic_shapes=({0: batch, 1: torch.export.Dim("seq")}, {0: batch}, {0: batch},
                                                {0: batch}),
                                custom_translation_table=xonnx.translation_table())
    path = tmp_path / "calls.onnx"
    program.save(str(path))
    proto = onnx.load(str(path))
    assert not [n for n in proto.graph.node if n.domain not in ("", "ai.onnx")]
    assert any(n.op_type == "Scan" for n in proto.graph.node)  # the mLSTM body's loop over chunks
    for B, S in ((3, 4), (1, 9)):
        inputs = _inputs(B, S)
        with torch.no_grad():
            want = model(*inputs)
        got = onnxruntime_outputs(path, *inputs)
        assert len(got) == 2
        for g, w in zip(got, want):
            assert g.shape == w.shape and rel_err(g, w) <= 1e-5, (B, S, rel_err(g, w))
