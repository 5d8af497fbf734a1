"""CUDA: every tile configuration of the generated Triton GEMM + epilogue kernels against the
fp32 reference (bf16 and fp16), and tuning decisions that survive a corrupt cache."""
import pytest
import torch

from tests.helpers import rel_err
from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels
from torch_xaccel.ops.gemm_epilogue.epilogue_ir import Epilogue
from torch_xaccel.ops.gemm_epilogue.reference import forward as reference

pytestmark = pytest.mark.gpu

GELU_RES = Epilogue(({"op": "acc", "index": 0}, {"op": "load", "operand": 0, "bcast": "row"},
                     {"op": "add", "in": [0, 1]}, {"op": "gelu_tanh", "in": [2]},
                     {"op": "load", "operand": 1, "bcast": "full"}, {"op": "add", "in": [3, 4]}), (5, 2)).to_json()
SWIGLU = Epilogue(({"op": "acc", "index": 0}, {"op": "acc", "index": 1}, {"op": "silu", "in": [0]},
                   {"op": "mul", "in": [2, 1]}), (3,)).to_json()


def _inputs(M, K, N, dtype, n_b, transposed=True):
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    bs = [(torch.randn(N, K, device="cuda", dtype=dtype) if transposed
           else torch.randn(K, N, device="cuda", dtype=dtype)) / K ** 0.5
          for _ in range(n_b)]
    return a, bs


def _check(case, cfg, a, bs, ops, text, transposed):
    if not case.usable(cfg):  # e.g. TMA with strides that are not 16-byte multiples
        return
    outs = case.new_outputs()
    for o in outs:
        o.fill_(float("nan"))  # every element must be written
    case.launch(cfg, outs)
    want = reference(a.double(), [b.double() for b in bs], [o.double() for o in ops], text, transposed)
    for o, w in zip(outs, want):
        assert not o.isnan().any()
        assert rel_err(o.view(w.shape), w) <= 1e-2, cfg
    # the launch plan a decided case keeps for later calls (decode's host time), same config
    plan = gemm_kernels._make_plan(case, cfg, a, bs, ops)
    if plan is None:
        return
    for o, w in zip(plan(a, bs, ops) or (), want):
        assert rel_err(o.view(w.shape), w) <= 1e-2, ("plan", cfg)
    # from its second call a kept plan launches the compiled kernel directly (codegen/triton_launch):
    # new values in the same layout, then `a` 2 bytes off 16-byte alignment, which Triton
    # specialised on, so that call must go through JITFunction.run again (TMA plans decline it)
    _check_direct(plan, cfg, a, bs, ops, text, transposed)


def _check_direct(plan, cfg, a, bs, ops, text, transposed):
    from torch_xaccel.codegen import triton_launch

    a_new, ops_new = torch.randn_like(a), [torch.randn_like(o) for o in ops]
    buf = torch.empty(a.numel() + 1, device="cuda", dtype=a.dtype)
    a_odd = buf[1:].view(a.shape).copy_(torch.randn_like(a))
    for x, xops, direct in ((a_new, ops_new, True), (a_odd, ops_new, False)):
        want = reference(x.double(), [b.double() for b in bs], [o.double() for o in xops], text, transposed)
        varying = (x.view(plan.M, plan.K), *bs, *(o.view(s) for o, s in zip(xops, plan.op_shapes)))
        assert bool(plan.direct and plan.direct.matches(varying)) == direct, cfg
        got = plan(x, bs, xops)
        assert got is not None or (plan.tma and not direct), cfg
        for o, w in zip(got or (), want):
            assert rel_err(o.view(w.shape), w) <= 1e-2, ("direct launch" if direct else "realigned", cfg)
    assert isinstance(plan.direct, triton_launch.DirectLaunch), cfg  # the aligned capture is kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1000, 96, 5])  # LARGE, SMALL_M and DECODE configuration lists, ragged edges
def test_every_config_single_gemm(dtype, M):

    torch.manual_seed(M)
    K, N = 520, 777
    a, bs = _inputs(M, K, N, dtype, 1)
    ops = [torch.randn(N, device="cuda", dtype=dtype), torch.randn(M, N, device="cuda", dtype=dtype)]
    case = gemm_kernels._Case(a, bs, ops, GELU_RES, True)
    for cfg in gemm_kernels.candidates(M, 1, dtype):
        _check(case, cfg, a, bs, ops, GELU_RES, True)


@pytest.mark.parametrize("M", [1000, 3])
@pytest.mark.parametrize("N", [8, 40])
def test_every_narrow_n_config(N, M):
    """The gate-projection lists (N <= 64; decode-size M has its own), ragged M and N."""

    torch.manual_seed(N)
    K = 520
    a, bs = _inputs(M, K, N, torch.bfloat16, 1)
    ops = [torch.randn(N, device="cuda", dtype=torch.bfloat16), torch.randn(M, N, device="cuda", dtype=torch.bfloat16)]
    case = gemm_kernels._Case(a, bs, ops, GELU_RES, True)
    for cfg in gemm_kernels.candidates(M, 1, torch.bfloat16, N):
        _check(case, cfg, a, bs, ops, GELU_RES, True)


@pytest.mark.parametrize("M", [700, 2])
@pytest.mark.parametrize("transposed", [True, False])
def test_every_config_dual_gemm_bf16(transposed, M):

    torch.manual_seed(1)
    K, N = 384, 500
    a, bs = _inputs(M, K, N, torch.bfloat16, 2, transposed)
    case = gemm_kernels._Case(a, bs, [], SWIGLU, transposed)
    for cfg in gemm_kernels.candidates(M, 2, torch.bfloat16):
        _check(case, cfg, a, bs, [], SWIGLU, transposed)


def test_fp32_uses_ieee_unless_tf32_enabled():

    torch.manual_seed(2)
    a, bs = _inputs(300, 256, 200, torch.float32, 1)
    ops = [torch.randn(200, device="cuda"), torch.randn(300, 200, device="cuda")]
    case = gemm_kernels._Case(a, bs, ops, GELU_RES, True)
    assert case.precision == ("tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")
    outs = case.new_outputs()
    case.launch(gemm_kernels.FP32[0], outs)
    want = reference(a.double(), [bs[0].double()], [o.double() for o in ops], GELU_RES, True)
    assert rel_err(outs[0], want[0]) <= (1e-3 if case.precision == "tf32" else 1e-5)


def test_corrupt_tuning_entry_is_rebuilt(tmp_path, monkeypatch):
    from torch_xaccel.codegen import cache

    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path))
    # the Triton configs and ATen only (CUTLASS: tests/gemm_epilogue/test_gpu_cutlass.py)
    monkeypatch.setenv("XACCEL_CUTLASS", "0")
    torch.manual_seed(3)
    a, bs = _inputs(2048, 1024, 2048, torch.bfloat16, 1)
    ops = [torch.randn(2048, device="cuda", dtype=torch.bfloat16),
           torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)]
    case = gemm_kernels._Case(a, bs, ops, GELU_RES, True)
    key = case.tuning_key()
    path = tmp_path / "tuning" / f"{cache.key_name(key)}.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"key": "' + key + '", "value": {"config": [999, 1, 1, 1, 1, 1]}}')  # not a known config
    monkeypatch.setattr(gemm_kernels, "_DECISIONS", {})
    out = gemm_kernels.provider("case-1", a, bs, ops, GELU_RES, True)
    entry = cache.read_entry("tuning", key)
    assert entry["config"] is None or tuple(entry["config"]) in gemm_kernels.candidates(2048, 1, torch.bfloat16)
    want = reference(a.double(), [bs[0].double()], [o.double() for o in ops], GELU_RES, True)
    assert rel_err(out[0], want[0]) <= 1e-2  # the kernel's result, or the ATen composition's


def test_gpu_time_excludes_the_cpu_launch_cost():
    """Small-M tuning compares GPU time: a call that costs 0.5 ms of CPU and a few microseconds of
    GPU must measure as the GPU part, and a large matmul must agree with do_bench (within the
    run-to-run spread; do_bench also flushes L2)."""
    import time

    import triton.testing

    from torch_xaccel.codegen import tuning

    x = torch.randn(64, 64, device="cuda")

    def slow_launch():
        time.sleep(0.0005)
        x.add_(1.0)
    assert tuning.gpu_ms(slow_launch) < 0.1
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    ratio = tuning.gpu_ms(lambda: a @ a) / triton.testing.do_bench(lambda: a @ a, return_mode="median")
    assert 0.6 < ratio < 1.4, ratio


def test_decode_tuning_times_every_decode_config_and_weighs_host_time(tmp_path, monkeypatch):
    """An M1 case (decode) times each DECODE config on the GPU; where ATen wins that, the entry
    holds both sides' host time and the decision is the lower GPU + host sum. The result matches
    the fp64 reference either way."""
    from torch_xaccel import runtime
    from torch_xaccel.codegen import cache

    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("XACCEL_CUTLASS", "0")
    monkeypatch.setattr(gemm_kernels, "_DECISIONS", {})
    torch.manual_seed(4)
    a, bs = _inputs(1, 4096, 4096, torch.bfloat16, 1)
    ops = [torch.randn(4096, device="cuda", dtype=torch.bfloat16),
           torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)]
    key = gemm_kernels._Case(a, bs, ops, GELU_RES, True).tuning_key()
    out = gemm_kernels.provider("case-decode", a, bs, ops, GELU_RES, True)
    want = reference(a.double(), [bs[0].double()], [o.double() for o in ops], GELU_RES, True)
    for o, w in zip(out, want):
        assert rel_err(o, w) <= 1e-2
    entry = cache.read_entry("tuning", key)
    gpu = {tuple(c): ms for c, ms, why in entry["timings"] if isinstance(c, list) and why == ""}
    host = {(tuple(c) if isinstance(c, list) else c): ms
            for c, ms, why in entry["timings"] if why == "host time per call"}
    assert set(gpu) == set(gemm_kernels.DECODE) and all(ms is not None for ms in gpu.values()), entry["timings"]
    aten_gpu = next(ms for c, ms, why in entry["timings"] if c == "aten" and why != "host time per call")
    best = min(gpu, key=gpu.get)
    if gpu[best] < aten_gpu:
        assert tuple(entry["config"]) == best and not host
    else:
        assert set(host) == {"aten", best}, entry["timings"]
        chose = best if gpu[best] + host[best] < aten_gpu + host["aten"] else None
        assert (tuple(entry["config"]) if entry["config"] else None) == chose
        noted = "chosen on GPU + host time" in runtime.CHOICES["case-decode"][2]  # what explain() reports
        assert noted == (chose is not None)
