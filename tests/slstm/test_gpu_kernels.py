"""The sLSTM kernels on the GPU against the fp32 reference (bf16 / fp16 inputs): forward relative
error <= 1e-2 (inputs, R and h rounded to 16 bits, fp32 state math) over the head shapes the
issue names, odd T, batch sizes that do not fill a tile, initial states and every variant."""
import pytest
import torch

from torch_xaccel import runtime
from torch_xaccel.codegen.slstm import cuda_kernels
from torch_xaccel.ops.slstm import reference

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs(B, T, NH, D, dtype, state=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Wx = torch.randn(B, T, 4, NH, D, device="cuda", generator=g).to(dtype)
    R = (torch.randn(NH, 4, D, D, device="cuda", generator=g) / D ** 0.5).to(dtype)
    b = torch.randn(4, NH, D, device="cuda", generator=g)
    states = [None] * 4
    if state:
        states = [torch.randn(B, NH, D, device="cuda", generator=g) * .5 for _ in range(4)]
        states[2] = states[2].abs() + 0.5
    return Wx, R, b, states


@pytest.mark.parametrize("NH,D", [(4, 192), (4, 256), (8, 128), (12, 64)])
@pytest.mark.parametrize("B,T", [(16, 37), (5, 64), (33, 9)])
def test_forward_matches_reference(NH, D, B, T):
    Wx, R, b, states = _inputs(B, T, NH, D, torch.bfloat16)
    assert cuda_kernels.why_not(Wx, R, b) is None
    variant = ("batch", True, False)
    events = len(runtime.EVENTS)
    got = torch.ops.xaccel.slstm(Wx, R, b, *states, *variant)
    want = reference.forward(Wx, R.float(), b, *states, *variant)
    assert len(runtime.EVENTS) == events, runtime.EVENTS[-1]  # the kernel ran, no fallback
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-2


@pytest.mark.parametrize("variant", [("element", False, False), ("element", True, False), ("batch", False, True),
                                     ("element", False, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_variants_and_initial_states(variant, dtype):
    Wx, R, b, states = _inputs(7, 50, 4, 192, dtype, state=True, seed=1)
    states[2][0] = 0  # one row fresh: the two fresh rules differ here
    events = len(runtime.EVENTS)
    got = torch.ops.xaccel.slstm(Wx, R, b, *states, *variant)
    want = reference.forward(Wx, R.float(), b, *states, *variant)
    assert len(runtime.EVENTS) == events, runtime.EVENTS[-1]
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-2


def test_every_cluster_configuration():
    Wx, R, b, states = _inputs(9, 33, 4, 192, torch.bfloat16, state=True, seed=2)
    want = reference.forward(Wx, R.float(), b, *states, "element", True, False)
    from torch_xaccel.codegen.slstm import configs

    for cfg in configs.candidates(192):
        got = cuda_kernels.launch(cfg, Wx, R, b.contiguous(), *[s.contiguous() for s in states], 0, "element", True,
                                  False)
        for g, w in zip(got, want):
            assert _rel(g, w) < 1e-2, cfg


def test_strided_input_and_T0():
    Wx, R, b, _ = _inputs(4, 20, 4, 192, torch.bfloat16, seed=3)
    view = Wx.transpose(0, 1).contiguous().transpose(0, 1)  # [T, B, ...] memory seen as [B, T, ...]
    got = torch.ops.xaccel.slstm(view, R, b, None, None, None, None, "batch", True, False)
    want = reference.forward(Wx, R.float(), b, None, None, None, None, "batch", True, False)
    assert _rel(got[0], want[0]) < 1e-2
    empty = torch.ops.xaccel.slstm(Wx[:, :0], R, b, None, None, None, None, "batch", True, False)
    assert empty[0].shape == (4, 0, 4, 192) and (empty[2] == 0).all()


def test_backward_on_gpu_matches_reference_grads():
    Wx, R, b, states = _inputs(3, 12, 4, 64, torch.bfloat16, state=True, seed=4)
    leaves = [t.detach().clone().requires_grad_() for t in (Wx, R, b, *states)]
    y = torch.ops.xaccel.slstm(*leaves, "element", True, False)[0]
    gy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, gy)
    ref_leaves = [t.detach().float().clone().requires_grad_() for t in (Wx, R, b, *states)]
    y_ref = reference.forward(*ref_leaves, "element", True, False)[0]
    ref = torch.autograd.grad(y_ref, ref_leaves, gy.float())
    for g, r in zip(grads, ref):
        assert _rel(g, r) < 5e-2
