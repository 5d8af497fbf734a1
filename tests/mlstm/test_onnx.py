"""ONNX export of the mLSTM family: xaccel.mlstm is one `xaccel` node whose FunctionProto is the
reference's chunkwise form (reference.prepared, then a Scan over chunks whose body is
reference.chunk_step, exported by torch.onnx), so memory stays linear in S; xaccel.mlstm_step's
body is reference.step. Checked in a fresh process, run by a stock onnxruntime at other batch and
sequence sizes (S not a multiple of the chunk, S below it), equal to PyTorch within 1e-5 (fp32),
with and without initial states; the demo's block and the xlstm package's xLSTMLarge fuse as in a
compile."""
import pytest
import torch

import torch_xaccel
from tests.helpers import onnx_checked_in_a_fresh_process, onnxruntime_outputs, rel_err

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
xonnx = pytest.importorskip("torch_xaccel.onnx")


class OpModule(torch.nn.Module):
    def __init__(self, states: bool):
        super().__init__()
        self.states = states

    def forward(self, q, k, v, i, f, C0, n0, m0):
        states = (C0, n0, m0) if self.states else (None, None, None)
        return torch.ops.xaccel.mlstm(q, k, v, i, f, *states, 1e-6, 16)


def _inputs(B, S, H=2, DK=8, DV=4):
    return (torch.randn(B, H, S, DK), torch.randn(B, H, S, DK), torch.randn(B, H, S, DV), torch.randn(B, H, S),
            torch.randn(B, H, S) + 2, torch.randn(B, H, DK, DV), torch.randn(B, H, DK).abs(), torch.randn(B, H))


@pytest.mark.parametrize("states", [False, True])
def test_op_exports_as_one_chunkwise_node_and_matches_at_other_sizes(tmp_path, states):
    torch.manual_seed(0)
    model, path = OpModule(states).eval(), tmp_path / "mlstm.onnx"
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    dyn = ({0: batch, 2: seq},) * 5 + ({0: batch},) * 3
    res = xonnx.export(model, _inputs(2, 20), path, dynamic_shapes=dyn, report=False)
    assert res.xaccel_nodes == {"mlstm": 1}
    scan = [n for f in res.model.functions for n in f.node if n.op_type == "Scan"]
    assert len(scan) == 1  # the chunk loop is a Scan, not unrolled
    onnx_checked_in_a_fresh_process(path)
    for B, S in ((3, 33), (1, 7)):
        inputs = _inputs(B, S)
        with torch.no_grad():
            want = model(*inputs)
        for g, w in zip(onnxruntime_outputs(path, *inputs), want):
            assert g.shape == w.shape and rel_err(g, w) <= 1e-5, (B, S, rel_err(g, w))


def test_step_exports_as_one_node(tmp_path):
    class Step(torch.nn.Module):
        def forward(self, q, k, v, i, f, C, n, m):
            return torch.ops.xaccel.mlstm_step(q, k, v, i, f, C, n, m, 1e-6, True)

    def inputs(B, H=2, DK=8, DV=4):
        return (torch.randn(B, H, DK), torch.randn(B, H, DK), torch.randn(B, H, DV), torch.randn(B, H),
                torch.randn(B, H), torch.randn(B, H, DK, DV), torch.randn(B, H, DK), torch.randn(B, H))
    torch.manual_seed(0)
    path = tmp_path / "step.onnx"
    res = xonnx.export(Step(), inputs(2), path, dynamic_shapes=({0: torch.export.Dim("batch")},) * 8, report=False)
    assert res.xaccel_nodes == {"mlstm_step": 1}
    onnx_checked_in_a_fresh_process(path)
    for B in (1, 5):
        x = inputs(B)
        with torch.no_grad():
            want = Step()(*x)
        for g, w in zip(onnxruntime_outputs(path, *x), want):
            assert rel_err(g, w) <= 1e-5


def test_xlstm_large_native_fuses_as_in_a_compile(tmp_path):
    """The xlstm package's xLSTMLarge (native kernels, inference): Dynamo's trace substitutes its
    chunkwise mLSTM as in a compile, so the export has one mlstm node per block. Its batch and
    its sequence length (a multiple of the 16-chunk the model pads to) stay symbolic: one export
    runs at two batch sizes and two lengths."""
    from torch.export import Dim

    from tests.mlstm.test_xlstm_package import _model

    model, tokens = _model(), torch.randint(0, 97, (2, 32))
    res = xonnx.export(model, (tokens,), tmp_path / "xl.onnx", dynamic_shapes=({0: Dim("batch"), 1: 16 * Dim("s")},),
                       report=False)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="xaccel")(tokens)
    assert res.xaccel_nodes["mlstm"] == torch_xaccel.last_report(1).counts()["mlstm"] == 2
    onnx_checked_in_a_fresh_process(tmp_path / "xl.onnx")
    for B, S in ((2, 32), (3, 48)):
        t = torch.randint(0, 97, (B, S))
        with torch.no_grad():
            want = model(t)
        assert rel_err(onnxruntime_outputs(tmp_path / "xl.onnx", t)[0], want) <= 1e-5, (B, S)


def _transformers_logits(chunk: int = 16) -> torch.nn.Module:
    """transformers' xLSTMForCausalLM (random weights, small config, inference), returning logits."""
    transformers = pytest.importorskip("transformers")

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, tokens):
            return self.m(tokens).logits

    cfg = transformers.xLSTMConfig(vocab_size=97, hidden_size=64, num_heads=2, num_blocks=2, qk_dim_factor=0.5,
                                   v_dim_factor=1.0, chunk_size=chunk, mode="inference", use_cache=False)
    torch.manual_seed(0)
    return Logits(transformers.xLSTMForCausalLM(cfg)).eval()


def test_transformers_xlstm_for_causal_lm_fuses_as_in_a_compile(tmp_path):
    """transformers' xLSTMForCausalLM (random weights, small config): the export's xaccel nodes
    equal the compile's counts, and one export with a dynamic batch runs at two batch sizes."""
    model, tokens = _transformers_logits(), torch.randint(0, 97, (2, 32))
    path = tmp_path / "hf.onnx"
    res = xonnx.export(model, (tokens,), path, dynamic_shapes=({0: torch.export.Dim("batch")},), report=False)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="xaccel")(tokens)
    compiled = torch_xaccel.last_report(1).counts()
    assert res.xaccel_nodes == {k: n for k, n in compiled.items() if n} and res.xaccel_nodes["mlstm"] == 2
    for B in (1, 3):
        t = torch.randint(0, 97, (B, 32))
        with torch.no_grad():
            want = model(t)
        assert rel_err(onnxruntime_outputs(path, t)[0], want) <= 1e-5


def test_transformers_xlstm_exports_a_sequence_length_that_is_a_multiple_of_its_chunk(tmp_path):
    """transformers' xLSTM pads the sequence to a multiple of its chunk size, so torch.export
    cannot keep a free S symbolic: that is a clear error naming the dim and the form to declare.
    Declared as chunk x Dim, one export runs at several lengths and batch sizes."""
    chunk = 16
    model, tokens = _transformers_logits(chunk), torch.randint(0, 97, (2, 32))
    Dim = torch.export.Dim
    with pytest.raises(ValueError, match=r"cannot keep seq symbolic.*chunk \* torch.export.Dim"):
        xonnx.export(model, (tokens,), tmp_path / "free.onnx", dynamic_shapes=({0: Dim("batch"), 1: Dim("seq")},),
                     report=False)
    path = tmp_path / "hf.onnx"
    res = xonnx.export(model, (tokens,), path, dynamic_shapes=({0: Dim("batch"), 1: chunk * Dim("s")},), report=False)
    assert res.xaccel_nodes["mlstm"] == 2
    for B, S in ((1, 32), (3, 48), (2, 80)):
        t = torch.randint(0, 97, (B, S))
        with torch.no_grad():
            want = model(t)
        assert rel_err(onnxruntime_outputs(path, t)[0], want) <= 1e-5
