import pytest


@pytest.fixture
def default_configs(monkeypatch, tmp_path):
    """The mLSTM kernels at their default configs, untuned: XACCEL_TUNE=0 over an empty cache (no
    stored decision to take either) and no decision remembered in this process. Tuning each shape
    class would compile and time every candidate; tests/mlstm/test_gpu_kernels.py checks the
    candidates one by one."""
    from torch_xaccel.codegen.mlstm import triton_kernels

    monkeypatch.setenv("XACCEL_TUNE", "0")
    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path / "untuned"))
    monkeypatch.setattr(triton_kernels, "_CHOSEN", {})
    monkeypatch.setattr(triton_kernels, "_FORWARD_PLANS", {})  # (a kept plan holds its decision)
