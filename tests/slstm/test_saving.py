"""Training graphs: an xaccel.slstm whose backward runs as a kernel becomes xaccel.slstm_saving
(lowering/slstm/saving.py), which keeps every step's pre-activations and states for that backward.
On the CPU no kernel runs, so the tests pretend one does; the saving op's kept states must equal
the reference's intermediates, and gradients must not change."""
import pytest
import torch

import torch_xaccel.codegen.slstm as kernels
from tests.helpers import rel_err
from torch_xaccel.ops.slstm import reference
from torch_xaccel.report import Report, collect

pytest.importorskip("xlstm.blocks.slstm.layer")
from xlstm.blocks.slstm.layer import sLSTMLayer, sLSTMLayerConfig  # noqa: E402


def _layer():
    torch.manual_seed(0)
    layer = sLSTMLayer(sLSTMLayerConfig(embedding_dim=32, num_heads=2, conv1d_kernel_size=4, backend="vanilla"))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape) * (p.shape[-1] ** -0.5 if "recurrent" in name else 0.5))
    return layer


def test_saving_op_keeps_the_reference_intermediates():
    g = torch.Generator().manual_seed(3)
    B, T, NH, D = 3, 6, 2, 4
    Wx = torch.randn(B, T, 4, NH, D, generator=g)
    R = torch.randn(NH, 4, D, D, generator=g) / D ** 0.5
    b = torch.randn(4, NH, D, generator=g)
    y, hT, cT, nT, mT, raw, cnm = torch.ops.xaccel.slstm_saving(Wx, R, b, None, None, None, None, "batch", True, False)
    want = reference.forward(Wx, R, b, None, None, None, None, "batch", True, False)
    for a, w in zip((y, hT, cT, nT, mT), want):
        torch.testing.assert_close(a, w)
    torch.testing.assert_close(cnm[:, :, -1], torch.stack((cT, nT, mT)))  # the state after the last step
    # the first step's pre-activations from a zero state are Wx + b
    torch.testing.assert_close(raw[:, 0], Wx[:, 0] + b)


@pytest.mark.parametrize("kernels_backward", [False, True])
def test_training_graph_keeps_states_only_where_the_kernel_backward_reads_them(monkeypatch, kernels_backward):
    monkeypatch.setattr(kernels, "backward_reads_kept_states", lambda Wx, R: kernels_backward)
    layer = _layer()
    x = torch.randn(2, 7, 32, requires_grad=True)
    want = layer(x)
    want_grads = torch.autograd.grad(want.square().sum(), [x, *layer.parameters()])
    torch._dynamo.reset()
    with collect() as graphs:
        got = torch.compile(layer, backend="xaccel")(x)
    got_grads = torch.autograd.grad(got.square().sum(), [x, *layer.parameters()])
    assert rel_err(got, want) < 1e-5
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) < 1e-5
    report = Report(graphs=graphs)
    notes = [r.note for r in report.replacements if r.op == "xaccel.slstm"]
    assert notes and all(("keeps its per-step states" in n) == kernels_backward for n in notes), str(report)
