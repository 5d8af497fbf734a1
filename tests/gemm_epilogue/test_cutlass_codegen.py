"""CUTLASS path on the CPU: the epilogue IR renders into an EVT kernel that nvcc compiles (when
nvcc and the CUTLASS headers are here), failed builds are kept and reported, and every case the
kernel does not cover names its reason. The kernels themselves run in
tests/gemm_epilogue/test_gpu_cutlass.py."""
import ctypes

import pytest
import torch

from torch_xaccel.codegen.gemm_epilogue import cutlass_kernels
from torch_xaccel.ops.gemm_epilogue.epilogue_ir import GRAD, UNARY, Epilogue

GELU_RES = Epilogue(({"op": "acc", "index": 0}, {"op": "load", "operand": 0, "bcast": "row"},
                     {"op": "add", "in": [0, 1]}, {"op": "gelu_tanh", "in": [2]},
                     {"op": "load", "operand": 1, "bcast": "full"}, {"op": "add", "in": [3, 4]}), (5,))
GELU_RES_ROW_ONLY = Epilogue(GELU_RES.nodes[:4], (3,)).to_json()  # bias + gelu_tanh
SWIGLU = Epilogue(({"op": "acc", "index": 0}, {"op": "silu", "in": [0]}, {"op": "acc", "index": 1},
                   {"op": "mul", "in": [1, 2]}), (3,)).to_json()
BF16 = [torch.bfloat16, torch.bfloat16]
needs_toolchain = pytest.mark.skipif(isinstance(cutlass_kernels.toolchain(), str),
                                     reason=f"CUTLASS toolchain: {cutlass_kernels.toolchain()}")


def _every_op() -> Epilogue:
    nodes = [{"op": "acc", "index": 0}, {"op": "load", "operand": 0, "bcast": "col"}, {"op": "const", "value": 0.5}]
    for op in UNARY:
        nodes.append({"op": op, "in": [len(nodes) - 1 if len(nodes) > 3 else 0]})
    for op in GRAD:
        nodes.append({"op": op, "in": [len(nodes) - 1, 1]})
    for op in ("add", "sub", "mul", "div"):
        nodes.append({"op": op, "in": [len(nodes) - 1, 2]})
    return Epilogue(tuple(nodes), (len(nodes) - 1,))


def test_render_writes_one_line_per_node_and_one_evt_child_per_operand():
    ep = _every_op()
    name, src = cutlass_kernels.render(ep, torch.float16, [torch.float16], {0: "col"}, False, cutlass_kernels.LARGE[0])
    assert name.startswith("gemm_epilogue_1x_cutlass_128x256x64_c2x1_")
    for i in range(len(ep.nodes)):
        assert f"const float v{i} = " in src
    assert src.count("Sm90ColBroadcast") == 1 and "Sm90SrcFetch" not in src
    assert "using ElementC = void;" in src and "cutlass::layout::RowMajor, kAlign,\n    float" in src  # B is K x N
    assert "0.5f" in src and "erff" in src and "fast_tanh" in src
    # the chain's arguments follow the EVT children: the accumulator, then operand 0
    assert "float chain0(float acc, float op0)" in src


def test_render_reads_a_full_operand_as_the_c_matrix():
    name, src = cutlass_kernels.render(GELU_RES, torch.bfloat16, BF16, {0: "row", 1: "full"}, True,
                                       cutlass_kernels.LARGE[3])
    assert "KernelTmaWarpSpecializedPingpong" in src and "Sm90SrcFetch<ElementC>" in src
    assert "using ElementC = cutlass::bfloat16_t;" in src and "ops[1]" in src
    other, _ = cutlass_kernels.render(GELU_RES, torch.bfloat16, BF16, {0: "row", 1: "full"}, True,
                                      cutlass_kernels.LARGE[0])
    assert other != name  # tile and schedule are part of the name


def test_an_extra_output_is_stored_by_its_own_chain_and_read_by_the_final_one():
    """outputs (gelu, pre-activation), as a training forward asks: ChainFn1 computes acc + bias
    under an auxiliary store; the final chain takes that value instead of adding the bias again."""
    ep = Epilogue(GELU_RES.nodes[:4], (3, 2))
    _, src = cutlass_kernels.render(ep, torch.bfloat16, BF16[:1], {0: "row"}, True, cutlass_kernels.LARGE[0])
    assert "float chain1(float acc, float op0)" in src and "float chain0(float acc, float out1)" in src
    final = src[src.index("float chain0("):src.index("}", src.index("float chain0("))]
    assert "const float v2 = out1;" in final and "op0" not in final
    assert "Sm90AuxStore<0, void, cutlass::bfloat16_t" in src and "outs[1]" in src


def test_cases_outside_the_cutlass_path_name_their_reason():
    a, b = torch.randn(64, 32), torch.randn(48, 32)
    assert "sm_90a" in cutlass_kernels.unsupported(GELU_RES, a, [b], [], True, {})


@needs_toolchain
def test_generated_source_compiles_and_exports_its_entry_points(tmp_path, monkeypatch):
    """nvcc 13 + the nvidia-cutlass headers compile the rendered kernel."""
    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path))
    name, src = cutlass_kernels.render(GELU_RES, torch.bfloat16, BF16, {0: "row", 1: "full"}, True,
                                       cutlass_kernels.LARGE[0])
    assert cutlass_kernels.state(name, src) == "absent"
    cutlass_kernels.wait_built(name, src)
    assert cutlass_kernels.state(name, src) == "built"
    lib = ctypes.CDLL(str(next((tmp_path / "cutlass").glob(f"{name}_*.so"))))
    assert lib.xaccel_run and lib.xaccel_workspace_size
    assert (tmp_path / "cutlass" / f"{next((tmp_path / 'cutlass').glob(f'{name}_*.so')).stem}.cu").read_text() == src
    assert not list((tmp_path / "cutlass").glob("*.tmp")) and not list((tmp_path / "cutlass").glob("*.building"))


@needs_toolchain
def test_a_failed_build_is_kept_and_reported_without_rebuilding(tmp_path, monkeypatch):
    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path))
    src = '#error "xaccel test: this kernel does not compile"\n'
    with pytest.raises(cutlass_kernels.CutlassBuildError, match="does not compile"):
        cutlass_kernels.wait_built("broken_kernel", src)
    assert cutlass_kernels.state("broken_kernel", src) == "failed"
    assert cutlass_kernels.start_build("broken_kernel", src) is None  # not retried
    with pytest.raises(cutlass_kernels.CutlassBuildError, match="does not compile"):
        cutlass_kernels.load("broken_kernel", src)


@needs_toolchain
def test_builds_wait_for_a_free_slot(tmp_path, monkeypatch):
    """At most max_builds() nvcc processes per cache, counted across processes by their markers;
    build_all starts the rest as slots free up."""
    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cutlass_kernels, "max_builds", lambda: 1)
    jobs = [(f"broken_{i}", f'#error "xaccel test {i}"\n') for i in range(3)]
    other = tmp_path / "cutlass" / "another_process.building"
    other.parent.mkdir(parents=True)
    other.touch()
    assert cutlass_kernels.start_build(*jobs[0]) is None and cutlass_kernels.state(*jobs[0]) == "absent"
    other.unlink()
    started, real = [], cutlass_kernels.start_build

    def counting(name, src):
        job = real(name, src)
        if job is not None:
            started.append(cutlass_kernels.running_builds())
        return job
    monkeypatch.setattr(cutlass_kernels, "start_build", counting)
    cutlass_kernels.build_all(jobs, "test")
    assert started == [1, 1, 1]  # one at a time
    assert all(cutlass_kernels.state(n, s) == "failed" for n, s in jobs)


def test_settle_waits_for_background_builds_then_the_next_call_retunes(monkeypatch):
    """bench's steady-state timing: settle() blocks while a pending CUTLASS build runs, then the
    case's next call sees it finished (and retunes) without waiting for the poll interval."""
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    states = iter(["building", "building", "building", "built"])
    monkeypatch.setattr(cutlass_kernels, "state", lambda name, src: next(states, "built"))
    monkeypatch.setattr(gemm_kernels, "_PENDING", {"case": (float("inf"), [("kernel", "source")])})
    monkeypatch.setattr(gemm_kernels.time, "sleep", lambda s: None)
    assert gemm_kernels.settle() == 1
    assert next(states, "done") == "done"  # it waited through every "building"
    assert gemm_kernels._pending_done("case") and "case" not in gemm_kernels._PENDING


def test_a_trial_run_leaves_cutlass_builds_to_the_cases_next_call(monkeypatch):
    """Measuring a region (tuning.trial) tunes a case as usual but starts none of its CUTLASS
    builds, so a replacement put back leaves no nvcc running; the case's next call outside the
    trial starts them (its pending poll), and only then."""
    from types import SimpleNamespace

    from torch_xaccel.codegen import tuning
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    started = []
    monkeypatch.setattr(cutlass_kernels, "start_build", lambda name, src: started.append(name))
    monkeypatch.setattr(cutlass_kernels, "state", lambda name, src: "absent")
    monkeypatch.setattr(gemm_kernels, "POLL_S", 0.0)
    monkeypatch.setattr(gemm_kernels, "interpreting", lambda: False)
    pending = [list(c) for c in cutlass_kernels.LARGE[:2]]
    tuned = tuning.Decision(config=list(gemm_kernels.LARGE[0]), entry={"pending": pending}, live=True)
    monkeypatch.setattr(gemm_kernels.tuning, "decide", lambda *a, **k: tuned)
    case = SimpleNamespace(M=4096, N=1024, dtype=torch.bfloat16, ep=SimpleNamespace(num_accs=1), a2=torch.empty(1),
                           usable=lambda c: True, cutlass_source=lambda c: (f"kernel {c[1]}x{c[2]}", "source"),
                           tuning_key=lambda: "case")
    with tuning.trial():
        cfg, waiting, _ = gemm_kernels.choose(case, None, None)
    assert cfg == gemm_kernels.LARGE[0] and waiting == [tuple(c) for c in pending] and started == []
    monkeypatch.setattr(gemm_kernels, "_PENDING", {"case": (0.0, [case.cutlass_source(c) for c in pending])})
    with tuning.trial():
        assert not gemm_kernels._pending_done("case") and started == []
    assert not gemm_kernels._pending_done("case")
    assert started == [case.cutlass_source(c)[0] for c in pending]
    started.clear()
    gemm_kernels.choose(case, None, None)  # outside a trial: at once
    assert len(started) == len(pending)


def test_prebuild_records_the_kernels_tuning_would_time_on_an_h200():
    """benchmarks/cutlass_prebuild.py runs a model on the CPU and collects, per gemm_epilogue call,
    the sources the GPU's tuner would build: SMALL for 64 < M <= 256, LARGE above, none for
    decode steps or calls CUTLASS cannot take (here a dual GEMM)."""
    import importlib.util
    import os

    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels
    from torch_xaccel.ops import gemm_epilogue
    from torch_xaccel.ops.gemm_epilogue import reference

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "cutlass_prebuild.py")
    spec = importlib.util.spec_from_file_location("cutlass_prebuild", path)
    prebuild = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prebuild)
    jobs, stats = {}, {}
    original = reference.forward
    try:
        prebuild.record_cases(jobs, stats)
        w, bias = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
        w1, w3 = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(64, 32, dtype=torch.bfloat16)
        for m in (8, 128, 320):
            x = torch.randn(m, 32, dtype=torch.bfloat16)
            gemm_epilogue.run(x, [w], [bias], GELU_RES_ROW_ONLY, True)
        x = torch.randn(320, 32, dtype=torch.bfloat16)
        gemm_epilogue.run(x, [w1, w3], [], SWIGLU, True)
    finally:
        reference.forward = original
    want = {}
    for m, cfgs in ((128, cutlass_kernels.SMALL), (320, cutlass_kernels.LARGE)):
        case = gemm_kernels._Case(torch.randn(m, 32, dtype=torch.bfloat16), [w], [bias], GELU_RES_ROW_ONLY, True)
        want.update(case.cutlass_source(c) for c in cfgs)
    assert jobs == want
    assert stats == {"decode step": 1, "dual GEMMs run as Triton kernels": 1}

