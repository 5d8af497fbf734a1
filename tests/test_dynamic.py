"""dynamic=True: one compile serves several batch sizes, with the fused op in the graph."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_xaccel.report import Report, collect


class Block(nn.Module):
    def __init__(self, d=16, h=40):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d)

    def forward(self, x):
        b, s, d = x.shape
        y = self.w2(F.silu(self.w1(x)) * self.w3(x)) + x
        return y.reshape(b * s, d)


def test_two_batch_sizes_one_compile_forward_and_backward():
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model, backend="xaccel", dynamic=True)
    with collect() as graphs:
        for batch, seq in [(2, 5), (7, 3)]:
            x = torch.randn(batch, seq, 16, requires_grad=True)
            out = compiled(x)
            ref = model(x)
            assert out.shape == (batch * seq, 16)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            g_out, = torch.autograd.grad(out.square().sum(), x)
            g_ref, = torch.autograd.grad(ref.square().sum(), x)
            torch.testing.assert_close(g_out, g_ref, rtol=1e-5, atol=1e-5)
    report = Report(graphs=graphs)
    assert len(graphs) == 1, "the second batch size must not recompile"
    assert report.counts()["gemm_epilogue"] == 2
