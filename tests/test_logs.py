"""Logging the torch way (torch_xaccel/logs.py): the `torch_xaccel` logger is torch._logging's
`xaccel` log (TORCH_LOGS="xaccel" INFO, "+xaccel" DEBUG), XACCEL_LOG=1 shows the report without it,
and library code prints nothing."""
import ast
import importlib.util
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torch_xaccel import logs
from torch_xaccel.report import GraphReport, publish

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch
    import torch.nn.functional as F

    def fn(x, w):
        return F.gelu(F.linear(x, w)) * 2

    if sys.argv[1:] == ["set_logs"]:
        import torch_xaccel
        torch._logging.set_logs(modules={"xaccel": logging.INFO})
    out = torch.compile(fn, backend="xaccel")(torch.randn(8, 4), torch.randn(6, 4))
    logging.getLogger("torch_xaccel.onnx").info("a child logger's line")
    print("shape", tuple(out.shape))
""")


def _run(tmp_path, *argv, **env_vars) -> subprocess.CompletedProcess:
    """SCRIPT in a fresh process (TORCH_LOGS is read when torch is imported). torch accepts the
    name `xaccel` at its import only where a module of that name can be found (logs.py): where the
    installed package does not provide one, a stub stands in for it."""
    paths = [str(ROOT)]
    if importlib.util.find_spec("xaccel") is None:
        (tmp_path / "xaccel.py").write_text('"""Lets TORCH_LOGS name `xaccel` before torch_xaccel loads."""\n')
        paths.insert(0, str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    env.update(env_vars, PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]),
               XACCEL_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *argv], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "shape (8, 6)\n"  # the report never goes to stdout
    return proc


def test_torch_logs_xaccel_shows_the_report(tmp_path):
    err = _run(tmp_path, TORCH_LOGS="xaccel").stderr
    assert "torch_xaccel report: 1 graph(s)" in err and "gemm_epilogue=1" in err
    assert "a child logger's line" in err  # torch_xaccel.* loggers follow (the ONNX export's)
    assert "compiling a graph" not in err  # DEBUG lines need +xaccel


def test_torch_logs_plus_xaccel_shows_debug(tmp_path):
    err = _run(tmp_path, TORCH_LOGS="+xaccel").stderr
    assert "torch_xaccel report: 1 graph(s)" in err
    assert "compiling a graph of 6 nodes with disable=False, patterns=every pattern, fallback='auto'" in err
    assert "choose=False [XACCEL_CHOOSE]" in err  # where each setting not at its default came from
    assert re.search(r"graph \d+: trace took \d+\.\d\d s", err)  # each phase of a first call as it ends


def test_set_logs_from_python_and_silence_by_default(tmp_path):
    assert "torch_xaccel report" in _run(tmp_path, "set_logs").stderr
    assert "torch_xaccel report" not in _run(tmp_path).stderr


def _fn(x, w):
    return F.gelu(F.linear(x, w)) * 2


def test_a_default_compile_prints_nothing(capsys):
    out = torch.compile(_fn, backend="xaccel")(torch.randn(8, 4), torch.randn(6, 4))
    assert out.shape == (8, 6)
    captured = capsys.readouterr()
    assert captured.out == "" and "torch_xaccel" not in captured.err


def test_a_choice_made_after_the_compile_is_logged(caplog):
    """The measured choice decides at the graph's first call, after its report was published."""
    report = GraphReport(index=7)
    report.choice = "runs eager [stored decision]"  # before publishing: part of the report itself
    with caplog.at_level(logging.INFO, logger=logs.NAME):
        publish(report)
        report.chosen, report.choice = "inductor", "runs inductor [measured, forward: inductor 0.1 ms]"
    lines = [r.getMessage() for r in caplog.records if r.name == logs.NAME]
    assert "torch_xaccel report: 1 graph(s)" in lines[0] and "graph 7: runs eager [stored decision]" in lines[0]
    assert lines[1:] == ["graph 7: runs inductor [measured, forward: inductor 0.1 ms]"]


def test_forced_lines_go_to_stderr_only_when_the_logger_drops_them(capsys, caplog):
    logs.info("forced %s", "line", force=True)
    assert "forced line" in capsys.readouterr().err
    with caplog.at_level(logging.INFO, logger=logs.NAME):  # enabled: through the logger, once
        logs.info("logged %s", "line", force=True)
    assert "logged line" not in capsys.readouterr().err and "logged line" in caplog.text


LIBRARY = [ROOT / "torch_xaccel", ROOT / "lowering", ROOT / "codegen", ROOT / "csrc"]
CLIS = {ROOT / "torch_xaccel" / "demo.py"}  # (and the folders torch_xaccel/bench/ and torch_xaccel/sweep/)


@pytest.mark.parametrize("folder", LIBRARY, ids=lambda p: p.name)
def test_library_code_does_not_print(folder):
    """Messages go to the torch_xaccel logger or, for real warnings, warnings.warn; print() is for
    the command-line tools."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        if path in CLIS or {"bench", "sweep"} & set(path.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
