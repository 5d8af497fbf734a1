"""The pointwise kernel on the GPU in bf16 and fp16 against the reference in fp32 (one rounding of
each output: at most one bf16 ulp apart where the two compute alike), with a transposed input and
broadcasts; and the xlstm stack compiled in bf16 with its groups fused, against eager."""
import pytest
import torch

from torch_xaccel import runtime
from torch_xaccel.codegen.pointwise import triton_kernels as k
from torch_xaccel.ops.pointwise import reference
from torch_xaccel.ops.pointwise.op import case_key
from torch_xaccel.ops.pointwise.program import Program

pytestmark = pytest.mark.gpu

L = [{"op": "load", "operand": j, "bcast": "full"} for j in range(3)]
# silu(x * y) + 0.5 * z, its tanh, and the gradient of silu at x times that
NODES = (*L, {"op": "mul", "in": [0, 1]}, {"op": "silu", "in": [3]}, {"op": "const", "value": 0.5},
         {"op": "mul", "in": [5, 2]}, {"op": "add", "in": [4, 6]}, {"op": "tanh", "in": [7]},
         {"op": "silu_grad", "in": [8, 0]})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("z_transposed", [False, True])
def test_kernel_matches_reference(dtype, z_transposed):
    shape = (4, 1000, 1536)
    x = torch.randn(shape, device="cuda").to(dtype)
    y = torch.randn(1536, device="cuda").to(dtype)
    z = torch.randn(4, 1536, 1000, device="cuda").to(dtype).transpose(1, 2) if z_transposed else \
        torch.randn(shape, device="cuda").to(dtype)
    strides = (tuple(x.stride()),) * 2
    p = Program(NODES, (9, 7), shape, strides, str(dtype).removeprefix("torch."))
    got = k.forward(case_key([x, y, z], p.to_json()), [x, y, z], p.to_json())
    want = reference.forward([x, y, z], p)
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    for g, w in zip(got, want):
        assert g.stride() == w.stride() and g.dtype == dtype
        assert ((g.float() - w.float()).abs() <= ulp * w.float().abs() + 1e-6).float().mean() > 0.999


def test_the_xlstm_stack_in_bf16_fuses_its_groups_and_matches_eager(monkeypatch):
    xlstm = pytest.importorskip("xlstm")
    from torch_xaccel.report import last_report

    monkeypatch.delenv("XACCEL_PATTERNS", raising=False)  # (the default patterns include pointwise)

    E, B, S = 512, 4, 256
    cfg = xlstm.xLSTMBlockStackConfig(
        mlstm_block=xlstm.mLSTMBlockConfig(mlstm=xlstm.mLSTMLayerConfig(conv1d_kernel_size=4, qkv_proj_blocksize=4,
                                                                        num_heads=4)),
        context_length=S, num_blocks=2, embedding_dim=E)
    torch.manual_seed(0)
    model = xlstm.xLSTMBlockStack(cfg).cuda().bfloat16()
    x = torch.randn(B, S, E, device="cuda").bfloat16()
    w = torch.randn(B, S, E, device="cuda")  # a cotangent: a square loss cancels through the final LayerNorm
    ref = xlstm.xLSTMBlockStack(cfg).cuda()
    ref.load_state_dict(model.float().state_dict())
    model.bfloat16()
    want = ref(x.float())
    (want * w).sum().backward()
    events, plans = len(runtime.EVENTS), len(k._PLANS)
    got = torch.compile(model, backend="xaccel")(x)
    (got.float() * w).sum().backward()
    assert len(runtime.EVENTS) == events, runtime.EVENTS[-1]
    assert len(k._PLANS) > plans, "the fused groups ran their reference, not the kernel"
    notes = {r.note for r in last_report().replacements if r.family == "pointwise"}
    assert notes == {"forward", "backward"}
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(got, want) < 1e-2  # (bf16 weights in both: bf16 activations' rounding, ~4e-3)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) < 5e-2, name
