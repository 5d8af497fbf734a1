"""The `xaccel` domain's onnx schemas (torch_xaccel.onnx.schemas): registered once, by importing
torch_xaccel.onnx and not by `import torch_xaccel`; a node's attributes are its schema's; onnx's
strict shape inference gives every xaccel node output the dtype and shape onnxruntime returns
(static dims as numbers, dynamic ones by name), with or without the bodies; a node the op refuses
is an inference error naming it."""
import subprocess
import sys

import pytest
import torch

from tests.helpers import inferred_shapes_match_onnxruntime, xaccel_nodes_fit_their_schemas

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
xonnx = pytest.importorskip("torch_xaccel.onnx")

import onnx  # noqa: E402 - after the skips
from onnx import TensorProto, helper  # noqa: E402


def test_registered_by_torch_xaccel_onnx_once_and_again_without_error():
    code = """if True:
        import sys
        import torch_xaccel
        assert "onnx" not in sys.modules, "import torch_xaccel must stay cheap"
        import onnx.defs
        assert not onnx.defs.has("mlstm", "xaccel")
        import torch_xaccel.onnx
        from torch_xaccel.onnx import functions, schemas
        assert all(onnx.defs.has(op, 1, "xaccel") for op in functions.translatable())
        schemas.register()
        print(sorted(s.name for s in onnx.defs.get_all_schemas() if s.domain == "xaccel"))"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == str(["causal_conv1d", "gemm_epilogue", "group_norm", "headwise", "mlstm",
                                               "mlstm_step", "skinny_linear", "slstm", "slstm_step"])


def _slstm():
    from tests.slstm.test_onnx import VARIANTS, OpModule, _states

    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    return (OpModule(VARIANTS[0], states=True), lambda B, S: (torch.randn(B, S, 4, 2, 8), *_states(B)),
            ({0: batch, 1: seq}, *({0: batch},) * 4))


def _slstm_step():
    from tests.slstm.test_onnx import VARIANTS, StepModule, _states

    return StepModule(VARIANTS[1]), lambda B, S: (torch.randn(B, 4, 2, 8), *_states(B)), \
        ({0: torch.export.Dim("batch")},) * 5


def _mlstm():
    from tests.mlstm.test_onnx import OpModule, _inputs

    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    return OpModule(states=True), _inputs, ({0: batch, 2: seq},) * 5 + ({0: batch},) * 3


def _swiglu():
    from torch_xaccel.demo import SwiGLU

    return SwiGLU(32, 96), lambda B, S: (torch.randn(B, S, 32),), \
        ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},)


@pytest.mark.parametrize("case", [_slstm, _slstm_step, _mlstm, _swiglu], ids=lambda c: c.__name__[1:])
def test_inferred_shapes_are_onnxruntime_s_at_other_sizes_with_and_without_bodies(case):
    torch.manual_seed(0)
    model, make, dynamic = case()
    res = xonnx.export(model.eval(), make(2, 5), dynamic_shapes=dynamic, report=False)
    xaccel_nodes_fit_their_schemas(res.model)
    for B, S in ((3, 7), (1, 4)):
        assert inferred_shapes_match_onnxruntime(res.model, *make(B, S)) > 0  # the batch at least is by name
    bare = onnx.ModelProto()
    bare.CopyFrom(res.model)
    del bare.functions[:]
    want = onnx.shape_inference.infer_shapes(res.model, strict_mode=True).graph
    got = onnx.shape_inference.infer_shapes(bare, strict_mode=True).graph
    assert [*got.value_info, *got.output] == [*want.value_info, *want.output]


def _bare_slstm(wx_shape, state_shape=None, fresh="batch"):
    """A model of one bare xaccel.slstm node."""
    names = ["Wx", "R", "b"] + (["h0", "c0", "n0", "m0"] if state_shape else [])
    shapes = [wx_shape, [2, 4, 8, 8], [4, 2, 8]] + [state_shape] * (4 if state_shape else 0)
    node = helper.make_node("slstm", names, ["y", "hT", "cT", "nT", "mT"], domain="xaccel", fresh=fresh,
                            clamp_gates=1, clamp_n=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                                            for n, s in zip(names, shapes)],
                              [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in node.output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("xaccel", 1)])


def test_a_bare_node_s_types_come_from_the_op():
    graph = onnx.shape_inference.infer_shapes(_bare_slstm(["B", "T", 4, 2, 8], ["B", 2, 8]), strict_mode=True).graph
    types = {v.name: (v.type.tensor_type.elem_type, [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim])
             for v in graph.output}
    assert types == {"y": (TensorProto.FLOAT, ["B", "T", 2, 8]), **{s: (TensorProto.FLOAT, ["B", 2, 8])
                                                                    for s in ("hT", "cT", "nT", "mT")}}


def test_a_node_the_op_refuses_is_an_inference_error_naming_it():
    with pytest.raises(onnx.shape_inference.InferenceError, match=r"xaccel::slstm: .*Wx must be \[B, T, 4, NH, D\]"):
        onnx.shape_inference.infer_shapes(_bare_slstm(["B", 4, 2, 8]), strict_mode=True)
    with pytest.raises(onnx.shape_inference.InferenceError, match=r"xaccel::slstm: fresh must be one of"):
        onnx.shape_inference.infer_shapes(_bare_slstm(["B", "T", 4, 2, 8], fresh="never"), strict_mode=True)
