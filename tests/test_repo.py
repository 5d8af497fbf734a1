"""The README's promises stay true: CI runs its test command; the demo passes."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _readme_commands():
    return re.findall(r"^(bash scripts/setup\.sh && python3 -m \S+.*)$", (ROOT / "README.md").read_text(), re.M)


def test_readme_starts_with_demo_and_test_commands_and_ci_runs_the_test_one():
    cmds = _readme_commands()
    assert cmds[:2] == ["bash scripts/setup.sh && python3 -m torch_xaccel.demo",
                        "bash scripts/setup.sh && python3 -m pytest -q"], cmds
    assert cmds[1] in (ROOT / ".ci" / "run").read_text()


def test_demo_main_job_passes():
    proc = subprocess.run([sys.executable, "-m", "torch_xaccel.demo", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "OK: compiled model matches eager" in proc.stdout and "gemm_epilogue=" in proc.stdout
