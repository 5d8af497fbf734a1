"""ONNX export of the sLSTM family: each xaccel.slstm / slstm_step is one `xaccel` node whose
FunctionProto (a Scan over reference.step, exported by torch.onnx itself) a stock onnxruntime runs.
The file passes the full checker in a fresh process and equals PyTorch within 1e-5 (fp32) at two
batch sizes and two sequence lengths from one export; the hand-written loop of the demo and the
xlstm package's sLSTMLayer become one node each."""
import pytest
import torch

from tests.helpers import onnx_checked_in_a_fresh_process, onnxruntime_outputs, rel_err

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
xonnx = pytest.importorskip("torch_xaccel.onnx")

VARIANTS = [("batch", True, False), ("element", False, True), ("element", True, True)]


class OpModule(torch.nn.Module):
    """xaccel.slstm called directly, optionally from given initial states."""

    def __init__(self, variant, NH=2, D=8, states=False):
        super().__init__()
        self.R = torch.nn.Parameter(torch.randn(NH, 4, D, D) / D ** 0.5)
        self.b = torch.nn.Parameter(torch.randn(4, NH, D))
        self.variant, self.states = variant, states

    def forward(self, Wx, h0, c0, n0, m0):
        states = (h0, c0, n0, m0) if self.states else (None,) * 4
        y, h, c, n, m = torch.ops.xaccel.slstm(Wx, self.R, self.b, *states, *self.variant)
        return y, h, c, n, m


def _states(B, NH=2, D=8, partly_fresh=False):
    h, c, m = (torch.randn(B, NH, D) * .5 for _ in range(3))
    n = torch.rand(B, NH, D) + .5
    if partly_fresh:
        n[0] = 0  # the two fresh rules differ here
    return h, c, n, m


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("states", [False, True])
def test_op_exports_as_one_node_and_matches_at_other_batch_and_sequence_sizes(tmp_path, variant, states):
    torch.manual_seed(0)
    model = OpModule(variant, states=states).eval()
    path = tmp_path / "slstm.onnx"
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    dyn = ({0: batch, 1: seq}, *({0: batch},) * 4)
    res = xonnx.export(model, (torch.randn(3, 7, 4, 2, 8), *_states(3)), path, dynamic_shapes=dyn, report=False)
    assert res.xaccel_nodes == {"slstm": 1}
    assert [f.name for f in res.model.functions] == ["slstm"]
    onnx_checked_in_a_fresh_process(path)
    for B, T in ((2, 5), (5, 11)):
        inputs = (torch.randn(B, T, 4, 2, 8), *_states(B, partly_fresh=states))
        with torch.no_grad():
            want = model(*inputs)
        got = onnxruntime_outputs(path, *inputs)
        for g, w in zip(got, want):
            assert g.shape == w.shape and rel_err(g, w) <= 1e-5, (B, T, rel_err(g, w))


def test_the_demo_loop_becomes_one_node(tmp_path):
    """A hand-written loop over time steps (the demo's SLSTMBlock): the same pass as the compile
    collapses it; the graph around it is standard ONNX."""
    from torch_xaccel.demo import SLSTMBlock

    torch.manual_seed(0)
    block, x = SLSTMBlock(32).eval(), torch.randn(2, 12, 32)
    res = xonnx.export(block, (x,), tmp_path / "block.onnx", report=False)
    assert res.xaccel_nodes["slstm"] == 1 and res.report.counts()["slstm"] == 1
    onnx_checked_in_a_fresh_process(tmp_path / "block.onnx")
    with torch.no_grad():
        want = block(x)
    assert rel_err(onnxruntime_outputs(tmp_path / "block.onnx", x)[0], want) <= 1e-5


def test_the_demo_loop_with_a_dynamic_batch_becomes_one_node(tmp_path):
    """The same loop exported with a symbolic batch dim: still one node (the loop's layouts are
    proven at two batch sizes), and onnxruntime equals PyTorch at other batch sizes."""
    from torch_xaccel.demo import SLSTMBlock

    torch.manual_seed(1)
    block, path = SLSTMBlock(32).eval(), tmp_path / "block.onnx"
    res = xonnx.export(block, (torch.randn(3, 12, 32),), path, dynamic_shapes=({0: torch.export.Dim("batch")},),
                       report=False)
    assert res.xaccel_nodes["slstm"] == 1 and res.report.counts()["slstm"] == 1
    onnx_checked_in_a_fresh_process(path)
    for B in (2, 5):
        x = torch.randn(B, 12, 32)
        with torch.no_grad():
            want = block(x)
        got = onnxruntime_outputs(path, x)[0]
        assert got.shape == want.shape and rel_err(got, want) <= 1e-5, B
    # the loop's length is fixed by the trace's unrolling: a symbolic one is a clear error
    with pytest.raises(ValueError, match="cannot keep seq symbolic.*Python loop over it.*leave it static"):
        xonnx.export(block, (torch.randn(3, 12, 32),), dynamic_shapes=({0: torch.export.Dim("batch"),
                                                                        1: torch.export.Dim("seq")},), report=False)


def test_a_hand_written_decode_step_with_a_dynamic_batch_becomes_one_step_node(tmp_path):
    """A hand-written decode step (flat states) exported with a symbolic batch: one slstm_step
    node, and onnxruntime equals PyTorch at other batch sizes."""
    from tests.slstm.test_lowering import decode_step_flat

    torch.manual_seed(2)
    NH, D, DIN = 2, 4, 5
    W, R, b = torch.randn(DIN, 4 * NH * D) * 0.5, torch.randn(NH, 4, D, D) * 0.5, torch.randn(4, NH, D)

    class Step(torch.nn.Module):
        def forward(self, x_t, h, c, n, m):
            return decode_step_flat(x_t, h, c, n, m, W, R, b)

    def inputs(B):
        return (torch.randn(B, DIN), torch.randn(B, NH * D) * 0.5, torch.randn(B, NH * D),
                torch.rand(B, NH * D) + 0.2, torch.randn(B, NH * D))
    path = tmp_path / "step.onnx"
    res = xonnx.export(Step(), inputs(3), path, dynamic_shapes=({0: torch.export.Dim("batch")},) * 5, report=False)
    assert res.xaccel_nodes.get("slstm_step") == 1, res.xaccel_nodes
    onnx_checked_in_a_fresh_process(path)
    for B in (2, 6):
        x = inputs(B)
        with torch.no_grad():
            want = Step()(*x)
        for g, w in zip(onnxruntime_outputs(path, *x), want):
            assert g.shape == w.shape and rel_err(g, w) <= 1e-5, B


def test_the_xlstm_package_layer_becomes_one_node(tmp_path):
    """The xlstm package's vanilla sLSTM branches on its state's values (`if torch.all(n == 0)`):
    the export traces with Dynamo, whose substitution traces the op (a non-strict export fails
    there)."""
    xlstm_layer = pytest.importorskip("xlstm.blocks.slstm.layer")
    torch.manual_seed(0)
    layer = xlstm_layer.sLSTMLayer(xlstm_layer.sLSTMLayerConfig(embedding_dim=32, num_heads=4, backend="vanilla",
                                                                conv1d_kernel_size=4)).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "recurrent" in name:
                p.copy_(torch.randn_like(p) * 0.3)  # the package initialises R to zeros
    x = torch.randn(2, 9, 32)
    res = xonnx.export(layer, (x,), tmp_path / "layer.onnx", report=False)
    assert res.xaccel_nodes["slstm"] == 1
    with pytest.raises(Exception, match="data-dependent"):
        xonnx.export(layer, (x,), report=False, strict=False)
    with torch.no_grad():
        want = layer(x)
    assert rel_err(onnxruntime_outputs(tmp_path / "layer.onnx", x)[0], want) <= 1e-5


class StepModule(torch.nn.Module):
    def __init__(self, variant, NH=2, D=8):
        super().__init__()
        self.R = torch.nn.Parameter(torch.randn(NH, 4, D, D) / D ** 0.5)
        self.b = torch.nn.Parameter(torch.randn(4, NH, D))
        self.variant = variant

    def forward(self, Wx, h, c, n, m):
        return torch.ops.xaccel.slstm_step(Wx, self.R, self.b, h, c, n, m, *self.variant)


@pytest.mark.parametrize("variant", VARIANTS[:2], ids=lambda v: "-".join(map(str, v)))
def test_step_exports_as_one_node(tmp_path, variant):
    torch.manual_seed(0)
    model = StepModule(variant).eval()
    batch = torch.export.Dim("batch")
    path = tmp_path / "step.onnx"
    res = xonnx.export(model, (torch.randn(3, 4, 2, 8), *_states(3)), path, dynamic_shapes=({0: batch},) * 5,
                       report=False)
    assert res.xaccel_nodes == {"slstm_step": 1}
    onnx_checked_in_a_fresh_process(path)
    for B in (2, 6):
        inputs = (torch.randn(B, 4, 2, 8), *_states(B, partly_fresh=True))
        with torch.no_grad():
            want = model(*inputs)
        for g, w in zip(onnxruntime_outputs(path, *inputs), want):
            assert rel_err(g, w) <= 1e-5


def test_without_functions_the_node_stays_bare(tmp_path):
    torch.manual_seed(0)
    res = xonnx.export(OpModule(VARIANTS[0]), (torch.randn(2, 3, 4, 2, 8), *_states(2)), functions=False,
                       report=False)
    nodes = [n for n in res.model.graph.node if n.domain == "xaccel"]
    assert len(nodes) == 1 and not res.model.functions
    attrs = {a.name: a for a in nodes[0].attribute}
    assert attrs["fresh"].s == b"batch" and attrs["clamp_gates"].i == 1 and attrs["clamp_n"].i == 0
