"""Every XACCEL_* switch, read at each compile; invalid values give one clear error."""
import pytest
import torch
import torch.nn.functional as F

import torch_xaccel
from torch_xaccel import config
from torch_xaccel.report import Report, collect


def fn(x, w):
    return F.gelu(F.linear(x, w)) * 2


def _run(backend="xaccel"):
    x, w = torch.randn(8, 4), torch.randn(6, 4)
    with collect() as graphs:
        out = torch.compile(fn, backend=backend)(x, w)
    torch.testing.assert_close(out, fn(x, w), rtol=1e-5, atol=1e-6)
    return Report(graphs=graphs)


def test_defaults(monkeypatch):
    monkeypatch.delenv("XACCEL_CHOOSE")  # (the suite's conftest turns the choice off)
    cfg = config.load()
    assert (cfg.disable, cfg.fallback, cfg.log, cfg.mlstm_keep_states, cfg.tune, cfg.compile_threads, cfg.cutlass,
            cfg.leave_to_inductor, cfg.choose) == (False, "auto", False, True, True, 8, "1", True, True)
    assert cfg.backward_fusion is None  # unset: the gemm_epilogue family decides (on where CUTLASS kernels run)
    assert "gemm_epilogue" in cfg.patterns
    assert str(cfg.cache_dir).endswith(".cache/torch_xaccel")


def test_disable_runs_graph_as_captured(xaccel_env):
    xaccel_env(XACCEL_DISABLE="1")
    report = _run()
    assert report.counts()["gemm_epilogue"] == 0 and report.graphs[0].disabled
    assert "XACCEL_DISABLE=1" in str(report)


def test_switches_are_read_at_each_compile(xaccel_env, monkeypatch):
    assert _run().counts()["gemm_epilogue"] == 1
    torch._dynamo.reset()
    xaccel_env(XACCEL_DISABLE="true")
    assert _run().counts()["gemm_epilogue"] == 0
    torch._dynamo.reset()
    monkeypatch.delenv("XACCEL_DISABLE")
    assert _run().counts()["gemm_epilogue"] == 1


def test_patterns_subset(xaccel_env):
    xaccel_env(XACCEL_PATTERNS="gemm_epilogue")
    assert _run().counts()["gemm_epilogue"] == 1


def test_fallback_inductor_runs_the_rest_through_inductor(xaccel_env):
    xaccel_env(XACCEL_FALLBACK="inductor")
    report = _run()
    assert report.counts()["gemm_epilogue"] == 1 and report.graphs[0].fallback_backend == "inductor"


def test_log_prints_report(xaccel_env, capsys):
    xaccel_env(XACCEL_LOG="1")
    _run()
    assert "gemm_epilogue=1" in capsys.readouterr().out


def test_tuning_is_on_unless_switched_off(xaccel_env):
    assert config.current().tune
    xaccel_env(XACCEL_TUNE="0")
    assert not config.current().tune  # current() follows the environment
    xaccel_env(XACCEL_TUNE="on")
    assert config.current().tune


def test_cache_dir(xaccel_env, tmp_path):
    xaccel_env(XACCEL_CACHE_DIR=str(tmp_path / "c"))
    assert config.load().cache_dir == tmp_path / "c"


@pytest.mark.parametrize("name,value,allowed", [
    ("XACCEL_DISABLE", "maybe", "0 or 1"),
    ("XACCEL_LOG", "loud", "0 or 1"),
    ("XACCEL_TUNE", "fast", "0 or 1"),
    ("XACCEL_MLSTM_KEEP_STATES", "some", "0 or 1"),
    ("XACCEL_BACKWARD_FUSION", "both", "0 or 1"),
    ("XACCEL_COMPILE_THREADS", "0", "whole number >= 1"),
    ("XACCEL_PATTERNS", "gemm_epilogue,attention", "gemm_epilogue"),
    ("XACCEL_FALLBACK", "tvm", "auto, eager, inductor"),
    ("XACCEL_CHOOSE", "sometimes", "0 or 1"),
])
def test_invalid_values_name_variable_and_allowed_values(xaccel_env, name, value, allowed):
    xaccel_env(**{name: value})
    with pytest.raises(torch_xaccel.XaccelConfigError, match=name) as err:
        config.load()
    assert allowed in str(err.value) and value.split(",")[-1] in str(err.value)
    # through torch.compile the same message reaches the user
    with pytest.raises(Exception, match=name):
        _run()


def test_cache_dir_that_is_a_file(xaccel_env, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    xaccel_env(XACCEL_CACHE_DIR=str(f))
    with pytest.raises(torch_xaccel.XaccelConfigError, match="XACCEL_CACHE_DIR"):
        config.load()


@pytest.mark.parametrize("value, mode", [("", "1"), ("wait", "wait"), ("OFF", "0"), ("true", "1"), ("0", "0")])
def test_cutlass_mode(monkeypatch, value, mode):
    monkeypatch.setenv("XACCEL_CUTLASS", value)
    assert config.load().cutlass == mode


def test_bad_cutlass_mode_is_a_clear_error(monkeypatch):
    from torch_xaccel.config import load
    from torch_xaccel.errors import XaccelConfigError

    monkeypatch.setenv("XACCEL_CUTLASS", "sometimes")
    with pytest.raises(XaccelConfigError, match="XACCEL_CUTLASS='sometimes' is invalid; allowed: 0, 1 or wait"):
        load()
