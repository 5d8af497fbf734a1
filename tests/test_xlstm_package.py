"""Real code: the xlstm 2.0.6 package's xLSTMLarge in its native PyTorch configuration compiles
through the backend, its chunkwise mLSTM kernels become xaccel.mlstm (found by provenance,
verified numerically), and the model equals eager (fp32), also when S needs padding."""
import pytest
import torch

import torch_xaccel
from tests.helpers import rel_err

xlstm_large = pytest.importorskip("xlstm.xlstm_large.model")


def _model():
    cfg = xlstm_large.xLSTMLargeConfig(
        embedding_dim=128, num_heads=2, num_blocks=2, vocab_size=97, chunk_size=16, mode="inference",
        chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
        step_kernel="native", return_last_states=False)
    torch.manual_seed(0)
    return xlstm_large.xLSTMLarge(cfg).eval()


@pytest.mark.parametrize("S", [32, 37])
def test_xlstm_large_native_mlstm_replaced_and_equal_to_eager(S):
    model, tokens = _model(), torch.randint(0, 97, (2, S))
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(tokens)
        got = torch.compile(model, backend="xaccel")(tokens)
    assert rel_err(got, want) <= 1e-5
    report = torch_xaccel.last_report(1)
    assert report.counts()["mlstm"] == 2, str(report)  # one per block
    assert all("verified numerically" in r.pattern for r in report.replacements if r.family == "mlstm")
    assert report.counts()["gemm_epilogue"] > 0
    assert not [f for f in report.fallbacks if f.family == "mlstm"], str(report)


@pytest.mark.gpu
def test_xlstm_large_native_on_cuda_runs_the_kernels_and_matches_eager():
    model, tokens = _model().cuda(), torch.randint(0, 97, (2, 64), device="cuda")
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(tokens)
        got = torch.compile(model, backend="xaccel")(tokens)
    assert rel_err(got, want) <= 1e-4
    assert torch_xaccel.last_report(1).counts()["mlstm"] == 2
