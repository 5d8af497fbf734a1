"""The ATen IR the passes match on: dropouts that return their input (p == 0, or not training)
are gone, so an nn.Dropout(0.0) in a training graph no longer hides a projection's residual add."""
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from tests.helpers import check_compiled
from torch_xaccel.lowering.normalize import drop_identity_dropouts


@pytest.mark.parametrize("p,train,dropped", [(0.0, True, 1), (0.3, False, 1), (0.3, True, 0)])
@pytest.mark.parametrize("fn", [F.dropout, F.alpha_dropout, F.feature_alpha_dropout], ids=lambda f: f.__name__)
def test_only_dropouts_that_return_their_input_go(fn, p, train, dropped):
    g = make_fx(lambda x: fn(x, p, train) * 2, pre_dispatch=True)(torch.randn(2, 3, 4))
    assert drop_identity_dropouts(g) == dropped
    x = torch.randn(2, 3, 4)
    if dropped:
        assert torch.equal(g(x), x * 2)


def test_a_residual_behind_dropout_zero_joins_the_projections_chain():
    """Training mode, nn.Dropout(0.0) between the projection and the residual add (the xlstm
    package's blocks): the linear and the add become one GEMM chain, equal to eager in forward and
    gradients."""
    torch.manual_seed(0)
    proj, drop = torch.nn.Linear(16, 16), torch.nn.Dropout(0.0).train()

    def block(x):
        return x + drop(proj(x))

    report = check_compiled(block, (torch.randn(4, 16, requires_grad=True),))
    assert report.counts()["gemm_epilogue"] == 1, str(report)
