"""Compile-and-compare helpers: a compiled model must equal eager in forward and gradients; and
kernel scripts run in Triton's interpreter."""
import os
import subprocess
import sys

import torch

from torch_xaccel.report import Report, collect


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _grads(fn, inputs):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    # a fixed random cotangent per output, so gradients of every output are checked
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs if o.is_floating_point())
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if leaves else ()
    return [o.detach() for o in outs], grads


def check_compiled(fn, inputs, *, dynamic=None, tol=1e-5, backend="xaccel") -> Report:
    """Run fn eagerly and compiled; assert forward and gradients agree; return the compile report."""
    ref_out, ref_grads = _grads(fn, inputs)
    with collect() as graphs:
        compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
        out, grads = _grads(compiled, inputs)
    assert len(out) == len(ref_out)
    for o, r in zip(out, ref_out):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert rel_err(o, r) <= tol, f"forward rel err {rel_err(o, r):.2e}"
    for g, r in zip(grads, ref_grads):
        assert (g is None) == (r is None)
        if r is not None:
            assert rel_err(g, r) <= tol, f"grad rel err {rel_err(g, r):.2e}"
    return Report(graphs=graphs)


def interpret(script: str, tmp_path, *argv: str, timeout: int = 600) -> str:
    """Run a test script in Triton's interpreter in a fresh process (TRITON_INTERPRET is read at
    import) with its own cache dir; its exit status must be 0. Its stdout."""
    env = dict(os.environ, TRITON_INTERPRET="1", XACCEL_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def fuzz_budget(default_cases: int) -> tuple[int, int]:
    """(first seed, number of cases) of a fuzz test: a fixed CI budget, or XACCEL_FUZZ_START /
    XACCEL_FUZZ_CASES."""
    return int(os.environ.get("XACCEL_FUZZ_START", "0")), int(os.environ.get("XACCEL_FUZZ_CASES", str(default_cases)))


def fuzz_batch(seeds, generate, check, describe) -> None:
    """Run check(generate(seed)) for every seed; fail with each failing case's description."""
    failures = []
    for seed in seeds:
        case = generate(seed)
        why = check(case)
        if why:
            failures.append(f"seed {seed}: {why}\n{describe(case)}")
    assert not failures, "\n\n".join(failures)


def onnx_checked_in_a_fresh_process(path) -> None:
    """onnx.checker.check_model(full_check=True) where nothing registered an xaccel schema (a
    user's machine): the file must stand on its own."""
    code = f"import onnx; onnx.checker.check_model(onnx.load({str(path)!r}), full_check=True)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def onnxruntime_outputs(path, *inputs) -> list:
    """The model's outputs from a stock onnxruntime (CPU) session."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.detach().numpy() for i, t in zip(session.get_inputs(), inputs)}
    return [torch.from_numpy(o) for o in session.run(None, feeds)]
