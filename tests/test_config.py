"""Every setting: XACCEL_* variables read at each compile, torch.compile's `xaccel.*` options,
torch_xaccel.config.patch; invalid values give one clear XaccelConfigError the user can catch."""
import dataclasses
import importlib.util
import pickle
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torch_xaccel
from tests.helpers import inductor_patches
from torch_xaccel import config, families
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
    assert (cfg.disable, cfg.fallback, cfg.log, cfg.mlstm_saving, cfg.tune, cfg.compile_threads, cfg.cutlass,
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


def test_log_writes_the_report_to_stderr_not_stdout(xaccel_env, capsys):
    """XACCEL_LOG=1: the report at INFO on the torch_xaccel logger, shown even where TORCH_LOGS
    does not enable it (tests/test_logs.py has TORCH_LOGS)."""
    xaccel_env(XACCEL_LOG="1")
    _run()
    out = capsys.readouterr()
    assert "gemm_epilogue=1" in out.err and "torch_xaccel report" in out.err and out.out == ""


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
    ("XACCEL_MLSTM_SAVING", "some", "0 or 1"),
    ("XACCEL_BACKWARD_FUSION", "both", "0 or 1"),
    ("XACCEL_LEAVE_TO_INDUCTOR", "maybe", "0 or 1"),
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
    # through torch.compile the same error reaches the user, at the first call
    with pytest.raises(torch_xaccel.XaccelConfigError, match=name):
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


# -- the table, options=, config.patch, precedence ------------------------------------------------

def _compile_run(**compile_kwargs):
    x, w = torch.randn(8, 4), torch.randn(6, 4)
    with collect() as graphs:
        out = torch.compile(fn, backend="xaccel", **compile_kwargs)(x, w)
    torch.testing.assert_close(out, fn(x, w), rtol=1e-5, atol=1e-6)
    return Report(graphs=graphs)


def test_one_table_names_every_setting(monkeypatch):
    from dataclasses import fields

    names = [f.name for f in fields(config.Config)]
    assert list(config.SETTINGS) == names
    assert [s.env for s in config.SETTINGS.values()] == ["XACCEL_" + n.upper() for n in names]
    assert config.option_keys() == ["xaccel." + n for n in names]
    monkeypatch.delenv("XACCEL_CHOOSE")
    assert config.load() == config.Config()  # the defaults are Config's


FAMILY_SETTINGS = {"cutlass": "gemm_epilogue", "backward_fusion": "gemm_epilogue",
                   "leave_to_inductor": "gemm_epilogue", "mlstm_saving": "mlstm"}


def test_each_family_declares_its_own_settings():
    """Family-only settings sit in their family's registry entry; config.py adds them after the
    shared ones and names none of them itself."""
    declared = {s.name: f.name for f in families.FAMILIES for s in f.settings}
    assert declared == FAMILY_SETTINGS
    shared = [f.name for f in dataclasses.fields(config.SharedConfig)]
    assert list(config.SETTINGS) == shared + list(declared)
    source = Path(config.__file__).read_text()
    assert not [name for name in declared if re.search(rf"\b{name}\b", source)]
    # Config holds them as fields like the shared ones: frozen, hashable, comparable, replaceable, picklable
    cfg = config.Config(cutlass="0", mlstm_saving=False)
    assert (cfg.cutlass, cfg.mlstm_saving, cfg.leave_to_inductor) == ("0", False, True)
    assert cfg == config.Config(cutlass="0", mlstm_saving=False) != config.Config()
    assert hash(cfg) == hash(config.Config(cutlass="0", mlstm_saving=False))
    assert dataclasses.replace(cfg, cutlass="1", mlstm_saving=True) == config.Config()
    assert pickle.loads(pickle.dumps(cfg)) == cfg and isinstance(cfg, config.SharedConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cutlass = "1"
    assert config.KERNEL_SETTINGS == {"cache_dir", "tune", "compile_threads", "cutlass"}


def test_a_family_setting_reads_like_a_shared_one(xaccel_env):
    """Default, then its variable, then config.patch, then the compile's options; described with
    where each value came from."""
    assert config.load().leave_to_inductor is True
    xaccel_env(XACCEL_LEAVE_TO_INDUCTOR="0", XACCEL_MLSTM_SAVING="off")
    assert (config.load().leave_to_inductor, config.current().mlstm_saving) == (False, False)
    with config.patch(leave_to_inductor="on"):
        assert config.current().leave_to_inductor is True
        ours, rest = config.split_options({"xaccel.leave_to_inductor": "no", "xaccel.cutlass": "WAIT"})
        assert (ours, rest) == ({"leave_to_inductor": False, "cutlass": "wait"}, {})
        assert config.load(ours).leave_to_inductor is False
        with config.applying(ours):
            assert (config.current().leave_to_inductor, config.current().cutlass) == (False, "wait")
        text = config.describe(config.load(ours), ours)
        assert "leave_to_inductor=False [options['xaccel.leave_to_inductor']]" in text
        assert "mlstm_saving=False [XACCEL_MLSTM_SAVING]" in text and "backward_fusion=None," in text
        assert "leave_to_inductor=True [config.patch]" in config.describe(config.current())
    assert config.current().leave_to_inductor is False
    # a kernel setting of a family given as an option applies at the graph's calls
    assert config.calling_with(lambda: config.current().cutlass, {"cutlass": "0"})() == "0"


def test_unknown_keys_list_every_setting_with_the_families():
    with pytest.raises(torch_xaccel.XaccelConfigError) as err:
        config.patch(cutlas="0")
    assert str(err.value).endswith("the settings are " + ", ".join(config.SETTINGS))
    assert all(name in str(err.value) for name in FAMILY_SETTINGS)
    with pytest.raises(torch_xaccel.XaccelConfigError) as err:
        config.split_options({"xaccel.cutlas": "0"})
    assert str(err.value).endswith("the xaccel options are " + ", ".join(config.option_keys()))
    assert all(f"xaccel.{name}" in str(err.value) for name in FAMILY_SETTINGS)


def _family(name, *settings):
    return families.Family(name, settings=settings)


@pytest.mark.parametrize("declared, match", [
    ((_family("a", families.FamilySetting("knob", True, "h")), _family("b", families.FamilySetting("knob", 0, "h"))),
     r"the setting 'knob' of family 'b' is also the a family's: a setting's name \(XACCEL_KNOB\)"),
    ((_family("a", families.FamilySetting("tune", True, "h")),), "the setting 'tune' of family 'a' is also shared"),
    ((_family("a", families.FamilySetting("knob", "2", "h", kind="choice", choices=("0", "1"))),),
     "its default '2' is not a value its kind 'choice' takes"),
    ((_family("a", families.FamilySetting("knob", True, "h", kind="switch")),), "has kind 'switch'"),
    ((_family("a", families.FamilySetting("knob", "x", "h", kind="choice")),), r"choice \(with them\)"),
])
def test_bad_family_settings_raise(declared, match):
    with pytest.raises(ValueError, match=match):
        config.family_settings(declared)


def test_a_name_clash_fails_the_import(monkeypatch):
    """A family declaring a setting another family (or the shared config) has: importing config.py
    raises, before any compile."""
    again = _family("probe", families.FamilySetting("mlstm_saving", False, "the same name again"))
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, again))
    spec = importlib.util.spec_from_file_location("torch_xaccel._config_probe", config.__file__)
    probe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, probe)  # (a module being imported is in sys.modules)
    with pytest.raises(ValueError, match="the setting 'mlstm_saving' of family 'probe' is also the mlstm family's"):
        spec.loader.exec_module(probe)


@pytest.mark.parametrize("key, value, field, expected", [
    ("xaccel.disable", True, "disable", True),
    ("xaccel.patterns", "mlstm,gemm_epilogue", "patterns", frozenset({"mlstm", "gemm_epilogue"})),
    ("xaccel.patterns", ["mlstm"], "patterns", frozenset({"mlstm"})),
    ("xaccel.fallback", "Eager", "fallback", "eager"),
    ("xaccel.compile_threads", 3, "compile_threads", 3),
    ("xaccel.cutlass", "wait", "cutlass", "wait"),
    ("xaccel.cutlass", False, "cutlass", "0"),
    ("xaccel.backward_fusion", None, "backward_fusion", None),
    ("xaccel.backward_fusion", "on", "backward_fusion", True),
    ("xaccel.leave_to_inductor", "off", "leave_to_inductor", False),
    ("xaccel.mlstm_saving", 0, "mlstm_saving", False),
    ("xaccel.tune", "off", "tune", False),
    ("xaccel.cache_dir", "~/x", "cache_dir", Path("~/x").expanduser()),
])
def test_option_values_parse_like_the_variables(key, value, field, expected):
    ours, rest = config.split_options({key: value, "max_autotune": True})
    assert rest == {"max_autotune": True}  # Inductor's keys stay Inductor's
    assert getattr(config.load(ours), field) == expected


def test_options_reach_the_compile():
    report = _compile_run(options={"xaccel.disable": True})
    assert report.graphs[0].disabled and report.counts()["gemm_epilogue"] == 0
    torch._dynamo.reset()
    report = _compile_run(options={"xaccel.patterns": "mlstm"})
    assert report.graphs[0].patterns == ("mlstm",) and report.counts()["gemm_epilogue"] == 0
    torch._dynamo.reset()
    report = _compile_run(options={"xaccel.fallback": "inductor"})
    assert report.graphs[0].fallback_backend == "inductor" and report.counts()["gemm_epilogue"] == 1


def test_xaccel_and_inductor_options_together(monkeypatch):
    """The xaccel.* keys are taken out; the rest reach Inductor's compile_fx unchanged."""
    seen = inductor_patches(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        report = _compile_run(options={"xaccel.fallback": "inductor", "epilogue_fusion": False})
    assert report.graphs[0].fallback_backend == "inductor"
    assert seen and {k: v for k, v in seen[0].items() if k != "post_grad_custom_pre_pass"} == {"epilogue_fusion": False}


def test_precedence_options_over_patch_over_environment(xaccel_env):
    xaccel_env(XACCEL_FALLBACK="inductor", XACCEL_TUNE="0")
    assert config.load().fallback == "inductor"
    with config.patch(fallback="eager"):
        assert (config.load().fallback, config.current().fallback, config.current().tune) == ("eager", "eager", False)
        assert config.load({"fallback": "auto"}).fallback == "auto"
        with config.applying({"fallback": "inductor"}):  # what the backend does with a compile's options
            assert config.current().fallback == "inductor"
        assert config.current().fallback == "eager"
    assert config.current().fallback == "inductor"
    # through torch.compile (XACCEL_CHOOSE=0: the planned rest is the fallback's)
    assert _compile_run().graphs[0].fallback_backend == "inductor"
    torch._dynamo.reset()
    with config.patch(fallback="eager"):
        assert _compile_run().graphs[0].fallback_backend == "eager"
        torch._dynamo.reset()
        assert _compile_run(options={"xaccel.fallback": "inductor"}).graphs[0].fallback_backend == "inductor"


def test_patch_as_context_manager_decorator_and_pair():
    before = config.current()
    with config.patch(fallback="eager", patterns="gemm_epilogue") as p:
        assert isinstance(p, config.patch)
        assert (config.current().fallback, config.current().patterns) == ("eager", frozenset({"gemm_epilogue"}))
        with config.patch({"xaccel.fallback": "inductor"}):  # nested; option keys work too
            assert config.current().fallback == "inductor"
        assert config.current().fallback == "eager"
    assert config.current() == before

    @config.patch({"tune": False})
    def inside():
        return config.current().tune
    assert inside() is False and config.current().tune is True
    with config.patch("choose", True):
        assert config.current().choose is True


def test_patch_restores_on_exceptions():
    before = config.current()
    with pytest.raises(KeyError):
        with config.patch(disable=True):
            raise KeyError("boom")
    assert config.current() == before

    @config.patch(disable=True)
    def fails():
        assert config.current().disable
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        fails()
    assert config.current() == before


def test_patch_must_hold_at_the_first_call_which_compiles():
    compiled = torch.compile(fn, backend="xaccel")
    with config.patch(disable=True):  # not yet compiled: torch.compile() itself reads nothing
        pass
    x, w = torch.randn(8, 4), torch.randn(6, 4)
    with collect() as graphs, config.patch(disable=True):
        compiled(x, w)
    assert graphs[0].disabled


@pytest.mark.parametrize("kwargs, match", [
    (dict(fallback="tvm"), r"config.patch\(fallback='tvm'\) is invalid; allowed: auto, eager, inductor"),
    (dict(patterns="gemm_epilogue,attention"), r"config.patch\(patterns=.*\(attention\).*gemm_epilogue"),
    (dict(compile_threads=0), "allowed: a whole number >= 1"),
    (dict(tune="sometimes"), "allowed: 0 or 1"),
    (dict(disable=None), "allowed: 0 or 1"),
    (dict(cutlass="sometimes"), r"config.patch\(cutlass='sometimes'\) is invalid; allowed: 0, 1 or wait"),
    (dict(leave_to_inductor=None), r"config.patch\(leave_to_inductor=None\) is invalid; allowed: 0 or 1"),
    (dict(fallbak="eager"), "unknown setting 'fallbak'; the settings are disable, patterns, fallback"),
])
def test_patch_validates_at_its_call(kwargs, match):
    before = config.current()
    with pytest.raises(torch_xaccel.XaccelConfigError, match=match):
        config.patch(**kwargs)
    assert config.current() == before


# -- invalid values reach the user as XaccelConfigError at the first call -------------------------

@pytest.mark.parametrize("options, match", [
    ({"xaccel.fallback": "tvm"}, r"options=\{'xaccel.fallback': 'tvm'\} is invalid; allowed: auto, eager, inductor"),
    ({"xaccel.patterns": "attention"}, r"\(attention\); allowed: a comma-separated subset of"),
    ({"xaccel.compile_threads": "many"}, "allowed: a whole number >= 1"),
    ({"xaccel.mlstm_saving": "some"}, r"options=\{'xaccel.mlstm_saving': 'some'\} is invalid; allowed: 0 or 1"),
    ({"cutlass": "0"}, r"unknown option 'cutlass'; did you mean 'xaccel.cutlass'\?"),  # a family's, no prefix
    ({"xaccel.fallbak": "eager"}, "unknown option 'xaccel.fallbak'; the xaccel options are xaccel.disable, "
                                  "xaccel.patterns, xaccel.fallback"),
    # an Inductor key: the same error type, naming both kinds of key
    ({"no_such_knob": True}, r"unknown option 'no_such_knob' \(options are Inductor config keys, or "
                             r"torch_xaccel's: xaccel.disable, xaccel.patterns"),
    ({"fallback": "eager"}, r"unknown option 'fallback'; did you mean 'xaccel.fallback'\?"),  # no prefix
])
def test_invalid_options_raise_at_the_first_call(options, match):
    compiled = torch.compile(fn, backend="xaccel", options=options)  # nothing compiles yet
    x, w = torch.randn(8, 4), torch.randn(6, 4)
    with pytest.raises(torch_xaccel.XaccelConfigError, match=match) as err:
        compiled(x, w)
    # also a ValueError, and still what torch raises for a failing backend
    assert isinstance(err.value, ValueError) and isinstance(err.value, torch._dynamo.exc.BackendCompilerFailed)
    assert "backend='xaccel' raised" in str(err.value)


def test_invalid_variable_raises_at_each_first_call_until_fixed(xaccel_env, monkeypatch):
    xaccel_env(XACCEL_FALLBACK="tvm")
    compiled = torch.compile(fn, backend="xaccel")
    x, w = torch.randn(8, 4), torch.randn(6, 4)
    for _ in range(2):  # not cached as a failure: every call tries to compile again
        try:
            compiled(x, w)
            raise AssertionError("no error")
        except torch_xaccel.XaccelConfigError as e:  # the user's except catches it
            assert "XACCEL_FALLBACK='tvm' is invalid" in str(e)
    monkeypatch.delenv("XACCEL_FALLBACK")
    torch.testing.assert_close(compiled(x, w), fn(x, w), rtol=1e-5, atol=1e-6)


def test_error_at_compile_pickles_as_the_plain_error():
    from torch_xaccel.errors import XaccelConfigError, at_compile

    err = at_compile(XaccelConfigError("XACCEL_TUNE='x' is invalid"))
    assert at_compile(err) is err
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is XaccelConfigError and str(back) == "XACCEL_TUNE='x' is invalid"


# -- options read while Dynamo traces and while a graph runs --------------------------------------

@torch._dynamo.assume_constant_result
def _traced_eager_or_not_saving() -> bool:
    """As the library substitutions read the config: while Dynamo traces, before the backend runs
    (a shared setting and a family's)."""
    return config.current().fallback == "eager" or not config.current().mlstm_saving


def _branches(x):
    return x * 2 if _traced_eager_or_not_saving() else x * 3


def test_options_apply_while_dynamo_traces():
    x = torch.ones(3)
    assert torch.equal(torch.compile(_branches, backend="xaccel")(x), x * 3)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(_branches, backend="xaccel", options={"xaccel.fallback": "eager"})(x), x * 2)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(_branches, backend="xaccel", options={"xaccel.mlstm_saving": 0})(x), x * 2)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(_branches, backend="eager")(x), x * 3)  # another backend: none
    torch._dynamo.reset()
    with config.patch(fallback="eager"):
        assert torch.equal(torch.compile(_branches, backend="xaccel")(x), x * 2)


def test_kernel_settings_given_as_options_apply_at_the_graphs_calls():
    """tune, cutlass, compile_threads and cache_dir are read when a kernel is built (any call):
    a graph compiled with them as options runs with them; other options need no wrapper."""
    def probe():
        return config.current().tune, config.current().fallback

    run = config.calling_with(probe, {"tune": False, "fallback": "eager"})
    assert run() == (False, "auto") and probe() == (True, "auto")
    assert config.calling_with(probe, {"fallback": "eager"}) is probe


@pytest.mark.parametrize("options", [{"xaccel.patterns": "gemm_epilogue"}, {"xaccel.disable": True}])
def test_options_switch_off_the_library_substitutions(options, monkeypatch):
    """The xlstm package's mLSTM kernels are substituted while Dynamo traces (before the backend
    sees the options): they read the compile's options there too, and trace the library's code."""
    pytest.importorskip("xlstm.xlstm_large.model")
    from tests.helpers import rel_err
    from tests.mlstm.test_xlstm_package import _model
    from torch_xaccel import backend

    traced = []
    real = backend._compile

    def spy(gm, *args):
        traced.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return real(gm, *args)
    monkeypatch.setattr(backend, "_compile", spy)
    model, tokens = _model(), torch.randint(0, 97, (2, 32))
    with torch.no_grad(), collect() as graphs:
        want = model(tokens)
        got = torch.compile(model, backend="xaccel")(tokens)
        assert any(t.startswith("xaccel.mlstm") for t in traced)  # substituted without the options
        traced.clear()
        torch._dynamo.reset()
        got = torch.compile(model, backend="xaccel", options=options)(tokens)
    assert rel_err(got, want) <= 1e-5
    assert traced and not any(t.startswith("xaccel.mlstm") for t in traced), traced
    assert Report(graphs=graphs[-1:]).counts()["mlstm"] == 0
