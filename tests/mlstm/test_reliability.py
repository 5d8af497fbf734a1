"""The mLSTM kernels decline what they cannot compute right: bf16 under Triton's interpreter,
whose bf16 dots are wrong, runs the reference."""
import torch


def test_bf16_under_the_interpreter_runs_the_reference(monkeypatch):
    from torch_xaccel.codegen.mlstm import triton_kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    B, H, S, D = 1, 2, 32, 16
    q, k, v = (torch.randn(B, H, S, D).bfloat16() for _ in range(3))
    i, f = torch.randn(B, H, S).bfloat16(), torch.randn(B, H, S).bfloat16()
    assert triton_kernels.forward(None, q, k, v, i, f, None, None, None, 1e-6, 16) is NotImplemented
    assert triton_kernels.backward(None, torch.randn_like(v), None, None, None, q, k, v, i, f, None, None, None,
                                   1e-6, 16) is NotImplemented
    C, n, m = torch.zeros(B, H, D, D), torch.zeros(B, H, D), torch.zeros(B, H)
    assert triton_kernels.step(None, q[:, :, 0], k[:, :, 0], v[:, :, 0], i[:, :, 0], f[:, :, 0], C, n, m,
                               1e-6) is NotImplemented
    assert not triton_kernels.backward_reads_kept_states("cpu", torch.bfloat16, D, D, 16)
