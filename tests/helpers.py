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


def plain_and_captured(fn, make_inputs, kernels, name: str):
    """fn(*inputs) called plainly, then captured in a CUDA graph and replayed on fresh inputs:
    [(inputs, output) plainly, (inputs, output) replayed], with how often `kernels.<name>` (the
    family's kernel function, counted by a wrapper) ran inside the capture."""
    import pytest

    calls = []
    real = getattr(kernels, name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, name, lambda *a: (calls.append(torch.cuda.is_current_stream_capturing()), real(*a))[1])
        plain_in = make_inputs()
        plain = (plain_in, fn(*plain_in))
        static = make_inputs()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*static)  # warm-up on a side stream, as torch.cuda.graph's users do
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*static)
        fresh = make_inputs()
        for s_t, f_t in zip(static, fresh):
            s_t.copy_(f_t)
        graph.replay()
        torch.cuda.synchronize()
    return [plain, (fresh, out.clone())], sum(calls)


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


def _without_xaccel_output_types(model):
    """A copy of `model` that no longer states the xaccel nodes' output shapes (value_info, the
    graph's outputs): what shape inference must find by itself. (The copy, the output names.)"""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    outs = [o for n in m.graph.node if n.domain == "xaccel" for o in n.output]
    kept = [v for v in m.graph.value_info if v.name not in outs]
    del m.graph.value_info[:]
    m.graph.value_info.extend(kept)
    for v in m.graph.output:
        if v.name in outs:
            v.type.tensor_type.ClearField("shape")
    return m, outs


def _named_size(dim_param: str, sizes: dict) -> int | None:
    """The size of a named dim: a graph input's dim name, or an expression of them as the exporter
    writes one ("seq*batch"); None for any other name."""
    try:
        return int(eval(dim_param, {"__builtins__": {}}, dict(sizes)))  # noqa: S307 - the file's own dim names
    except Exception:  # noqa: BLE001 - not a size of the inputs
        return None


def inferred_shapes_match_onnxruntime(model, *inputs) -> int:
    """onnx's strict shape inference (through the registered xaccel schemas) gives every xaccel node
    output the dtype and shape that onnxruntime returns for `inputs`: static dims as those numbers,
    dynamic dims by a graph input's dim name (or an expression of them), bound to that input's
    size. Returns how many of the inferred dims are symbolic."""
    import onnx
    import onnxruntime

    m, outs = _without_xaccel_output_types(model)
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    types = {v.name: v.type.tensor_type for v in (*inferred.graph.value_info, *inferred.graph.output)}
    listed = {v.name for v in inferred.graph.output}
    inferred.graph.output.extend(onnx.helper.make_value_info(o, onnx.TypeProto(tensor_type=types[o]))
                                 for o in outs if o not in listed)
    session = onnxruntime.InferenceSession(inferred.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.detach().numpy() for i, t in zip(session.get_inputs(), inputs)}
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    sizes = {d.dim_param: n for v in model.graph.input if v.name in feeds
             for d, n in zip(v.type.tensor_type.shape.dim, feeds[v.name].shape) if d.dim_param}
    symbolic = 0
    for o in outs:
        dims = types[o].shape.dim
        shape = tuple(d.dim_value if d.HasField("dim_value") else _named_size(d.dim_param, sizes) for d in dims)
        assert types[o].HasField("shape") and None not in shape, f"{o}: inferred {types[o]}"
        assert shape == got[o].shape, (o, shape, got[o].shape)
        assert onnx.helper.tensor_dtype_to_np_dtype(types[o].elem_type) == got[o].dtype, o
        symbolic += sum(d.HasField("dim_param") for d in dims)
    return symbolic


def xaccel_nodes_fit_their_schemas(model) -> None:
    """Every xaccel node's attributes are its registered schema's (names and types; an optional
    one may be left out), and the full checker, which now reads those schemas, passes."""
    import onnx

    for node in (n for n in model.graph.node if n.domain == "xaccel"):
        declared = onnx.defs.get_schema(node.op_type, 1, "xaccel").attributes
        written = {a.name: a.type for a in node.attribute}
        assert written == {k: int(a.type) for k, a in declared.items() if k in written}, node.op_type
        assert {k for k, a in declared.items() if a.required} <= set(written), node.op_type
    onnx.checker.check_model(model, full_check=True)


def inductor_patches(monkeypatch) -> list[dict]:
    """The config patches each call of Inductor's compile_fx receives from now on (it still runs)."""
    import torch._inductor.compile_fx as cfx

    seen: list[dict] = []
    real = cfx.compile_fx

    def spy(gm, inputs, *args, config_patches=None, **kw):
        seen.append(dict(config_patches or {}))
        return real(gm, inputs, *args, config_patches=config_patches, **kw)
    monkeypatch.setattr(cfx, "compile_fx", spy)
    return seen
