"""CUDA (sm_90): the generated CUTLASS GEMM + epilogue kernels against the fp64 reference (bf16 and
fp16, ragged edges, both B layouts, every operand kind), and the tuner's use of them: built before
timing with XACCEL_CUTLASS=wait, built in the background (and then timed) with the default."""
import time

import pytest
import torch

from tests.helpers import rel_err
from torch_xaccel.codegen.gemm_epilogue import cutlass_kernels
from torch_xaccel.ops.gemm_epilogue.epilogue_ir import Epilogue
from torch_xaccel.ops.gemm_epilogue.reference import forward as reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
    or isinstance(cutlass_kernels.toolchain(), str),
    reason="needs an sm_90 GPU, nvcc and the nvidia-cutlass headers")]


def _ep(*nodes, out=None):
    return Epilogue(tuple(nodes), out or (len(nodes) - 1,)).to_json()


ACC = {"op": "acc", "index": 0}
GELU_RES = _ep(ACC, {"op": "load", "operand": 0, "bcast": "row"}, {"op": "add", "in": [0, 1]},
               {"op": "gelu_tanh", "in": [2]}, {"op": "load", "operand": 1, "bcast": "full"},
               {"op": "add", "in": [3, 4]})
SILU_COL_SCALAR = _ep(ACC, {"op": "silu", "in": [0]}, {"op": "load", "operand": 0, "bcast": "col"},
                      {"op": "mul", "in": [1, 2]}, {"op": "load", "operand": 1, "bcast": "scalar"},
                      {"op": "mul", "in": [3, 4]})
GELU_GRAD = _ep(ACC, {"op": "load", "operand": 0, "bcast": "full"}, {"op": "gelu_grad", "in": [0, 1]})
GELU_TANH_GRAD = _ep(ACC, {"op": "load", "operand": 0, "bcast": "full"}, {"op": "gelu_tanh_grad", "in": [0, 1]})
# two outputs, as a training forward emits them: the chain's result and the value its backward reads
BIAS_GELU_SAVED = _ep(ACC, {"op": "load", "operand": 0, "bcast": "row"}, {"op": "add", "in": [0, 1]},
                      {"op": "gelu_tanh", "in": [2]}, out=(3, 2))
GELU_RES_SAVED = _ep(ACC, {"op": "load", "operand": 0, "bcast": "row"}, {"op": "add", "in": [0, 1]},
                     {"op": "gelu_tanh", "in": [2]}, {"op": "load", "operand": 1, "bcast": "full"},
                     {"op": "add", "in": [3, 4]}, out=(5, 2))
RELU_FP32_BIAS = _ep(ACC, {"op": "const", "value": 0.25}, {"op": "sub", "in": [0, 1]}, {"op": "relu", "in": [2]},
                     {"op": "load", "operand": 0, "bcast": "row"}, {"op": "div", "in": [3, 4]})

M, K, N = 1000, 520, 776  # M and N not multiples of any tile


def _operands(kinds, dtype):
    make = {"row": lambda d: torch.rand(N, device="cuda", dtype=d) + 0.5,
            "full": lambda d: torch.randn(M, N, device="cuda", dtype=d),
            "col": lambda d: torch.randn(M, 1, device="cuda", dtype=d),
            "scalar": lambda d: torch.tensor(0.7, device="cuda", dtype=d)}
    return [make[k](d or dtype) for k, d in kinds]


CASES = [  # (epilogue, operand kinds and dtypes (None: the input dtype), input dtype, B transposed, configs)
    (GELU_RES, [("row", None), ("full", None)], torch.bfloat16, True, cutlass_kernels.LARGE),
    (GELU_RES, [("row", None), ("full", None)], torch.bfloat16, True, cutlass_kernels.SMALL),
    (GELU_RES_SAVED, [("row", None), ("full", None)], torch.float16, True, cutlass_kernels.LARGE[:1]),
    (BIAS_GELU_SAVED, [("row", None)], torch.bfloat16, True, cutlass_kernels.LARGE[:1]),
    (SILU_COL_SCALAR, [("col", None), ("scalar", torch.float32)], torch.bfloat16, False, cutlass_kernels.LARGE[:1]),
    (GELU_GRAD, [("full", None)], torch.bfloat16, False, cutlass_kernels.LARGE[:1]),
    (GELU_TANH_GRAD, [("full", None)], torch.bfloat16, False, cutlass_kernels.LARGE[3:4]),
    (RELU_FP32_BIAS, [("row", torch.float32)], torch.bfloat16, True, cutlass_kernels.LARGE[3:4]),
]


def sources():
    """(name, source) of every kernel these tests build (the device run may build them ahead)."""
    out = []
    for text, kinds, dtype, transposed, cfgs in CASES:
        ep = Epilogue.from_json(text)
        bcast = ep.broadcasts()
        op_dtypes = [d or dtype for _, d in kinds]
        out += [cutlass_kernels.render(ep, dtype, op_dtypes, bcast, transposed, cfg) for cfg in cfgs]
    return out


@pytest.fixture(scope="module", autouse=True)
def _built_ahead():
    """Build every kernel of this module at once (nvcc processes in parallel) instead of one
    after another as the tests first launch them."""
    cutlass_kernels.build_all(sources(), "tests")


@pytest.mark.parametrize("case", range(len(CASES)))
def test_cutlass_kernels_match_the_fp64_reference(case):
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    text, kinds, dtype, transposed, cfgs = CASES[case]
    torch.manual_seed(case)
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = (torch.randn(N, K, device="cuda", dtype=dtype) if transposed
         else torch.randn(K, N, device="cuda", dtype=dtype)) / K ** 0.5
    ops = _operands(kinds, dtype)
    want = reference(a.double(), [b.double()], [o.double() for o in ops], text, transposed)
    c = gemm_kernels._Case(a, [b], ops, text, transposed)
    assert c.cutlass_reason is None
    for cfg in cfgs:
        outs = c.new_outputs()
        for o in outs:
            o.fill_(float("nan"))  # every element must be written
        c.launch(cfg, outs)
        torch.cuda.synchronize()
        for o, w in zip(outs, want):
            assert not o.isnan().any(), cfg
            assert rel_err(o, w) <= 1e-2, (cfg, rel_err(o, w))


def test_unaligned_rows_are_left_to_triton():
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    a = torch.randn(512, 100, device="cuda", dtype=torch.bfloat16)  # K = 100: rows of 200 bytes
    b = torch.randn(256, 100, device="cuda", dtype=torch.bfloat16)
    c = gemm_kernels._Case(a, [b], [torch.rand(256, device="cuda")], RELU_FP32_BIAS, True)
    assert "16-byte" in c.cutlass_reason
    assert gemm_kernels.cutlass_candidates(c) == []


def test_decode_sized_m_gets_the_small_configs_and_decode_steps_none():
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    def cands(m):
        a = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        return gemm_kernels.cutlass_candidates(
            gemm_kernels._Case(a, [b], [torch.rand(512, device="cuda")], RELU_FP32_BIAS, True))
    assert cands(cutlass_kernels.SMALL_MIN_M) == []
    assert cands(cutlass_kernels.SMALL_MIN_M + 8) == cands(gemm_kernels.SMALL_M_ROWS) == cutlass_kernels.SMALL
    assert cands(gemm_kernels.SMALL_M_ROWS + 8) == cutlass_kernels.LARGE


def _tune_entry(monkeypatch, mode, shape):
    from torch_xaccel.codegen import cache
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    monkeypatch.setenv("XACCEL_CUTLASS", mode)
    monkeypatch.setattr(gemm_kernels, "_DECISIONS", {})
    monkeypatch.setattr(gemm_kernels, "_PENDING", {})
    m, k, n = shape
    torch.manual_seed(m)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    ops = [torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(m, n, device="cuda", dtype=torch.bfloat16)]
    want = reference(a.double(), [b.double()], [o.double() for o in ops], GELU_RES, True)[0]

    def call():
        out = gemm_kernels.provider(("case", shape), a, [b], ops, GELU_RES, True)
        assert rel_err(out[0], want) <= 1e-2
        return cache.read_entry("tuning", gemm_kernels._Case(a, [b], ops, GELU_RES, True).tuning_key())
    return call


def _cutlass_timed(entry) -> list:
    return [t for t in entry["timings"]
            if t[0] != "cutlass" and t[0][0] in cutlass_kernels.VARIANTS and t[1] is not None]


def test_wait_mode_builds_and_times_every_cutlass_config(monkeypatch):
    call = _tune_entry(monkeypatch, "wait", (2048, 1024, 2048))
    entry = call()
    assert entry["pending"] == []
    assert len(_cutlass_timed(entry)) == len(cutlass_kernels.LARGE), entry["timings"]


def test_background_mode_tunes_without_waiting_then_again_with_cutlass(monkeypatch, tmp_path):
    """Default mode: the first call tunes without the (unbuilt) CUTLASS kernel and starts its
    build; once built, a later call times the case again with it."""
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cutlass_kernels, "LARGE", cutlass_kernels.LARGE[1:2])
    monkeypatch.setattr(gemm_kernels, "POLL_S", 0.0)
    call = _tune_entry(monkeypatch, "1", (1536, 1024, 2048))
    t0 = time.perf_counter()
    first = call()
    assert time.perf_counter() - t0 < 60  # did not wait for nvcc
    assert first["pending"] == [list(cutlass_kernels.LARGE[0])] and not _cutlass_timed(first)
    name, src = cutlass_kernels.render(Epilogue.from_json(GELU_RES), torch.bfloat16, [torch.bfloat16] * 2,
                                       {0: "row", 1: "full"}, True, cutlass_kernels.LARGE[0])
    while cutlass_kernels.state(name, src) == "building" and time.perf_counter() - t0 < 600:
        time.sleep(1)
    assert cutlass_kernels.state(name, src) == "built"
    second = call()
    assert second["pending"] == [] and len(_cutlass_timed(second)) == 1, second["timings"]


def test_cutlass_kernel_captured_in_a_cuda_graph_replays_with_new_inputs():
    """mode="reduce-overhead" and graphed decode loops capture the ops: a CUTLASS launch (TMA
    descriptors built on the host, then one kernel) must record into a CUDA graph and, replayed
    after the inputs changed in place, compute from the new values."""
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    text, kinds, dtype, transposed, cfgs = CASES[0]
    torch.manual_seed(7)
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5
    ops = _operands(kinds, dtype)
    c = gemm_kernels._Case(a, [b], ops, text, True)
    outs = c.new_outputs()
    c.launch(cfgs[0], outs)  # loads the library outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.launch(cfgs[0], outs)
    a.copy_(torch.randn_like(a))
    outs[0].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = reference(a.double(), [b.double()], [o.double() for o in ops], text, True)[0]
    assert rel_err(outs[0], want) <= 1e-2
