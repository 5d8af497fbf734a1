import pytest

from torch_xaccel import lowering


@pytest.fixture
def lowered(monkeypatch):
    """The ATen graphs after the passes (the backend imports run_passes when it compiles)."""
    graphs = []
    real = lowering.run_passes

    def keep(gm, ctx):
        graphs.append(real(gm, ctx))
        return graphs[-1]
    monkeypatch.setattr(lowering, "run_passes", keep)
    return graphs
