"""backend="xaccel" resolves through the installed entry point, without importing the package."""
import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_backend_found_without_import():
    out = _run("""
        import sys, torch
        assert "torch_xaccel" not in sys.modules
        f = lambda x, w: torch.relu(x @ w.t()) * 2
        x, w = torch.randn(4, 3), torch.randn(5, 3)
        y = torch.compile(f, backend="xaccel")(x, w)
        assert torch.allclose(y, f(x, w))
        import torch_xaccel
        print(torch_xaccel.last_report().counts()["gemm_epilogue"])
    """)
    assert out.strip() == "1"


def test_import_first_does_not_break_lookup():
    out = _run("""
        import torch, torch_xaccel
        from torch._dynamo import list_backends
        assert "xaccel" in list_backends()
        f = lambda x, w: torch.sigmoid(x @ w.t())
        x, w = torch.randn(4, 3), torch.randn(5, 3)
        assert torch.allclose(torch.compile(f, backend="xaccel")(x, w), f(x, w))
        torch._dynamo.reset()
        assert torch.allclose(torch.compile(f, backend="xaccel")(x, w), f(x, w))
        print(torch_xaccel.last_report().counts()["gemm_epilogue"])
    """)
    assert out.strip() == "1"  # the graph compiled before the reset no longer runs: not in the report


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="torch_dynamo_backends") if ep.name == "xaccel"]
    assert len(eps) == 1 and eps[0].value == "torch_xaccel.backend:xaccel_backend"
