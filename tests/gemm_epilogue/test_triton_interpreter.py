"""Kernel logic of the generated Triton GEMM + epilogue, run by Triton's interpreter on the CPU
(float32, small odd shapes), against the op's reference: the pointer kernel through the op's
provider, and the persistent TMA kernels (whole-tile and half-tile epilogue) launched directly."""
import textwrap

import pytest

from tests.helpers import interpret

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import os, random, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from torch_xaccel.ops.gemm_epilogue.epilogue_ir import Epilogue, UNARY, BINARY
    from torch_xaccel.ops.gemm_epilogue.reference import forward as reference
    from torch_xaccel import runtime
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    def chain(rng, n_ops, n_acc):
        nodes = [{"op": "acc", "index": i} for i in range(n_acc)]
        cur = 0 if n_acc == 1 else len(nodes)
        if n_acc == 2:
            nodes += [{"op": "silu", "in": [0]}, {"op": "mul", "in": [2, 1]}]
            cur = 3
        kinds = {0: "row", 1: "full", 2: "col", 3: "scalar"}
        for _ in range(n_ops):
            if rng.random() < 0.4:
                nodes.append({"op": rng.choice(UNARY), "in": [cur]})
            else:
                j = rng.randrange(5)
                nodes.append({"op": "const", "value": rng.uniform(0.5, 2)} if j == 4
                             else {"op": "load", "operand": j, "bcast": kinds[j]})
                op = rng.choice(["add", "sub", "mul"])
                nodes.append({"op": op, "in": [cur, len(nodes) - 1]})
            cur = len(nodes) - 1
        return Epilogue(tuple(nodes), (cur, 0))

    torch.manual_seed(0)
    rng = random.Random(0)
    fails = 0
    for trial, (lead, M, K, N, n_acc, bt) in enumerate([((), 37, 45, 29, 1, True), ((2,), 19, 70, 33, 1, False),
                                                      ((), 64, 32, 64, 2, True), ((3,), 5, 17, 40, 2, True),
                                                      ((), 1, 64, 50, 1, True)]):
        ep = chain(rng, 5, n_acc)
        a = torch.randn(*lead, M, K)
        bs = [torch.randn(N, K) if bt else torch.randn(K, N) for _ in range(n_acc)]
        ops = [torch.randn(N), torch.randn(*lead, M, N), torch.randn(*lead, M, 1), torch.randn(())]
        used = sorted({n["operand"] for n in ep.nodes if n["op"] == "load"})
        ops = [ops[j] for j in range(max(used) + 1)] if used else []
        text = ep.to_json()
        got = gemm_kernels.provider("k%d" % trial, a, bs, ops, text, bt)
        assert got is not NotImplemented
        want = reference(a, bs, ops, text, bt)
        # a second call with fresh inputs in the same layout runs the launch plan the first left
        # (_Case unavailable: the general path would fail)
        fresh = lambda t: torch.randn_like(t)
        a2, bs2, ops2 = fresh(a), [fresh(b) for b in bs], [fresh(t) for t in ops]
        case_cls, gemm_kernels._Case = gemm_kernels._Case, None
        got2 = gemm_kernels.provider("k%d" % trial, a2, bs2, ops2, text, bt)
        gemm_kernels._Case = case_cls
        want2 = reference(a2, bs2, ops2, text, bt)
        for g, w, g2, w2 in zip(got, want, got2, want2):
            err, err2 = (((x - y).norm() / y.norm()).item() for x, y in ((g, w), (g2, w2)))
            print(trial, ep.describe(), tuple(g.shape), f"{err:.1e}", f"plan {err2:.1e}")
            fails += not (g.shape == w.shape == g2.shape and err < 1e-5 and err2 < 1e-5)
    # large M keeps a plan too (a model of large GEMMs can be host-bound), but no more than MAX_PLANS
    plans = len(gemm_kernels._PLANS)
    acc_only = Epilogue(({"op": "acc", "index": 0},), (0,)).to_json()
    out = gemm_kernels.provider("big", torch.randn(300, 16), [torch.randn(8, 16)], [], acc_only, True)
    fails += len(gemm_kernels._PLANS) != plans + 1 or out[0].shape != (300, 8)
    gemm_kernels.MAX_PLANS = plans + 1
    gemm_kernels.provider("small", torch.randn(3, 16), [torch.randn(8, 16)], [], acc_only, True)
    fails += len(gemm_kernels._PLANS) != 1  # started over
    # the persistent TMA variants (the GPU's usual picks), forced on for CPU tensors. Triton 3.6's
    # interpreter hands program ids over as 1-element arrays, which a persistent range cannot use.
    import triton
    tma_cases = [(100, 64, 96, 1, True), (70, 32, 64, 2, True), (33, 64, 64, 1, False)]
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
        print("tma variants skipped on Triton", triton.__version__)
        tma_cases = []
    gemm_kernels._num_sms = lambda device: 3
    for trial, (M, K, N, n_acc, bt) in enumerate(tma_cases):
        ep = chain(rng, 4, n_acc)
        a = torch.randn(M, K)
        bs = [torch.randn(N, K) if bt else torch.randn(K, N) for _ in range(n_acc)]
        ops = [torch.randn(N), torch.randn(M, N), torch.randn(M, 1), torch.randn(())]
        case = gemm_kernels._Case(a, bs, ops, ep.to_json(), bt)
        case.tma = True
        want = reference(a, bs, ops, ep.to_json(), bt)
        for variant in ("tma", "tma2"):
            cfg = (variant, 32, 32, 32, 4, 4, 1, trial % 2)
            outs = case.new_outputs()
            case.launch(cfg, outs)
            err = max(((g - w).norm() / w.norm()).item() for g, w in zip(outs, want))
            # and its launch plan (descriptors built per call), on the same inputs
            planned = gemm_kernels._Plan(case, cfg)(a, bs, ops)
            err2 = max(((g - w).norm() / w.norm()).item() for g, w in zip(planned, want))
            print(variant, trial, ep.describe(), f"{err:.1e}", f"plan {err2:.1e}")
            fails += not (err < 1e-5 and err2 < 1e-5)
    raise SystemExit(fails)
""")


def test_generated_kernels_match_reference_in_interpreter(tmp_path):
    out = interpret(SCRIPT, tmp_path)
    lines = out.splitlines()
    assert len(lines) == 10 + (6 if "skipped" not in out else 1)  # 5 ptr cases x 2 outputs + 3 TMA x 2 variants
    kernels = list((tmp_path / "kernels").glob("gemm_epilogue_*.py"))
    assert kernels and "op: xaccel::gemm_epilogue" in kernels[0].read_text()  # readable sources in the cache


GRAD_SCRIPT = textwrap.dedent("""
    import os, torch
    os.environ["TRITON_INTERPRET"] = "1"
    import triton
    from torch_xaccel.ops.gemm_epilogue.epilogue_ir import Epilogue, GRAD
    from torch_xaccel.ops.gemm_epilogue.reference import forward as reference
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    torch.manual_seed(0)
    gemm_kernels._num_sms = lambda device: 3
    tma = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)
    fails = 0
    for i, op in enumerate(GRAD):  # g = the GEMM's result, x = a full operand; then a residual-style add
        ep = Epilogue(({"op": "acc", "index": 0}, {"op": "load", "operand": 0, "bcast": "full"},
                       {"op": op, "in": [0, 1]}, {"op": "load", "operand": 1, "bcast": "row"},
                       {"op": "add", "in": [2, 3]}), (4,)).to_json()
        M, K, N, bt = 37 + i, 40, 36, i % 2 == 0  # 16-byte row strides for the TMA descriptors
        a = torch.randn(M, K)
        b = torch.randn(N, K) if bt else torch.randn(K, N)
        x = torch.randn(M, N) * 2
        if op in ("sigmoid_grad", "tanh_grad"):
            x = torch.tanh(x)  # an activation's output
        ops = [x, torch.randn(N)]
        want = reference(a, [b], ops, ep, bt)[0]
        got = [gemm_kernels.provider("g%d" % i, a, [b], ops, ep, bt)[0]]
        if tma:  # the half-tile epilogue repeats each node's temporaries per half
            case = gemm_kernels._Case(a, [b], ops, ep, bt)
            case.tma = True
            for variant in ("tma", "tma2"):
                outs = case.new_outputs()
                case.launch((variant, 32, 32, 32, 4, 4, 1, 0), outs)
                got.append(outs[0])
        errs = [((g - want).norm() / want.norm()).item() for g in got]
        print(op, " ".join(f"{e:.1e}" for e in errs))
        fails += not all(e < 1e-5 for e in errs)
    raise SystemExit(fails)
""")


def test_gradient_ops_in_generated_kernels_match_reference_in_interpreter(tmp_path):
    """The activation-gradient ops that backward graphs fuse (gelu_tanh_grad needs a temporary per node)."""
    assert len(interpret(GRAD_SCRIPT, tmp_path).splitlines()) == 6


def test_every_listed_config_fits_shared_memory():
    """A config over sm_90's shared memory fails to launch on the GPU (Triton 3.6 raises
    OutOfResources for 128x256x64 with 4 stages): none may be listed."""
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as tg

    for lst, n in ((tg.LARGE, 1), (tg.SMALL_M, 1), (tg.DUAL, 2), (tg.NARROW_N, 1), (tg.DECODE, 1),
                   (tg.DECODE_NARROW_N, 1)):
        for cfg in lst:
            assert tg.shared_bytes(cfg, n) <= tg.SHARED_LIMIT, cfg
    assert tg.shared_bytes(("tma", 128, 256, 64, 8, 8, 4, 0), 1) > tg.SHARED_LIMIT  # Triton 3.6 asks 262176 B


def test_candidates_fit_shared_memory_for_their_gemm_count_and_dtype():
    """With XACCEL_TUNE=0 the first candidate runs untimed, so it must fit: SMALL_M's first config
    does not for a small-M SwiGLU (two weight matrices), whose call would fall back to ATen."""
    import torch

    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as tg

    for dtype in (torch.bfloat16, torch.float32):
        for m, n in ((1, 4096), (128, 4096), (8192, 4096), (8192, 8), (128, 8), (1, 8)):
            for n_gemms in (1, 2):
                cands = tg.candidates(m, n_gemms, dtype, n)
                assert cands, (m, n, n_gemms, dtype)
                assert all(tg.shared_bytes(c, n_gemms, dtype.itemsize) <= tg.SHARED_LIMIT for c in cands)
    assert tg.shared_bytes(tg.SMALL_M[0], 2) > tg.SHARED_LIMIT  # so the dual list really is narrowed
    assert tg.candidates(128, 2, torch.bfloat16, 4096)[0] != tg.SMALL_M[0]


def test_candidate_lists_by_shape_class():
    """Narrow outputs (gate projections) get the short narrow-tile list, whatever M; SwiGLU-style
    dual GEMMs and fp32 keep theirs."""
    import torch

    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as tg

    assert tg.candidates(8192, 1, torch.bfloat16, 8) == tg.NARROW_N == tg.candidates(17, 1, torch.float16, 64)
    assert tg.candidates(1, 1, torch.float16, 64) == tg.DECODE_NARROW_N == tg.candidates(16, 1, torch.bfloat16, 8)
    assert tg.candidates(8192, 1, torch.bfloat16, 65) == tg.LARGE == tg.candidates(8192, 1, torch.bfloat16)
    assert tg.candidates(128, 1, torch.bfloat16, 4096) == tg.SMALL_M == tg.candidates(17, 1, torch.bfloat16, 4096)
    assert tg.candidates(1, 1, torch.bfloat16, 4096) == tg.DECODE == tg.candidates(16, 1, torch.bfloat16)
    assert tg.candidates(8, 2, torch.bfloat16, 4096) == [c for c in tg.DECODE
                                                          if tg.shared_bytes(c, 2) <= tg.SHARED_LIMIT]
    assert all(c[1] == 16 for c in tg.DECODE + tg.DECODE_NARROW_N[1:])  # one tl.dot's worth of rows
    assert tg.candidates(8192, 2, torch.bfloat16, 8) == tg.DUAL
    assert tg.candidates(8192, 1, torch.float32, 8) == tg.FP32


def test_outputs_or_inputs_past_int32_offsets_go_to_aten(monkeypatch):
    """The GEMM kernels compute offsets in int32: an LM head at 64K tokens x 50304 vocab has
    3.3e9 outputs. Such a call runs the ATen composition (cuBLAS takes 64-bit sizes) instead of a
    kernel that would wrap around; one just below the limit still goes to the kernels."""
    import torch

    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as tg
    from torch_xaccel.ops.gemm_epilogue import reference as gemm_epilogue

    monkeypatch.setattr(gemm_epilogue, "aten_composition", lambda *a: "aten")

    def tuned(*a):
        raise AssertionError("a kernel was considered")
    monkeypatch.setattr(tg, "choose", tuned)
    big = torch.empty(65536, 4096, dtype=torch.bfloat16, device="meta")
    head = torch.empty(50304, 4096, dtype=torch.bfloat16, device="meta")
    assert not tg._int32_reach(big, [head], [], True)
    assert tg.provider(("k",), big, [head], [], "unused", True) == "aten"
    sliced = torch.empty(2 ** 19, 8192, dtype=torch.bfloat16, device="meta")[:, :4096]  # a reaches 4.3e9
    assert tg._int32_reach(sliced[:4], [head], [], True)  # its first rows: small
    assert not tg._int32_reach(sliced, [head[:8]], [], True)  # 4.2e6 outputs, but a reaches past 2^31
    assert tg._int32_reach(torch.empty(40000, 4096, dtype=torch.bfloat16, device="meta"), [head], [], True)


def test_launch_plan_runs_only_for_its_decision_and_layout(monkeypatch):
    """A call reuses a case's launch plan only while the decision it was built for stands (the
    same config object, no CUTLASS build pending for the case) and its inputs have the plan's
    strides; a plan that declines a call (TMA alignment) hands it to the general path."""
    import torch

    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as tg
    from torch_xaccel.ops.gemm_epilogue import reference as gemm_epilogue

    monkeypatch.setattr(gemm_epilogue, "aten_composition", lambda *a: "general path")
    monkeypatch.setattr(tg, "_int32_reach", lambda *a: False)  # the general path's first exit
    monkeypatch.setattr(tg, "_DECISIONS", {})
    monkeypatch.setattr(tg, "_PENDING", {})
    monkeypatch.setattr(tg, "_PLANS", {})
    a, b = torch.randn(4, 8), torch.randn(6, 8)
    cfg = ("ptr", 32, 32, 32, 4, 4, 1, 0)

    class Plan:
        def __init__(self, result):
            self.cfg, self.result = cfg, result

        def __call__(self, a, bs, operands):
            return self.result
    tg._PLANS[tg._plan_key("k", a, [b], [])] = Plan("planned")
    assert tg.provider("k", a, [b], [], "unused", True) == "general path"  # not decided (yet)
    tg._DECISIONS["k"] = cfg
    assert tg.provider("k", a, [b], [], "unused", True) == "planned"
    assert tg.provider("k", a.t().contiguous().t(), [b], [], "unused", True) == "general path"  # other strides
    tg._PENDING["k"] = (0.0, [])
    assert tg.provider("k", a, [b], [], "unused", True) == "general path"  # retuned once CUTLASS builds
    del tg._PENDING["k"]
    tg._DECISIONS["k"] = tuple(cfg)[:4] + tuple(cfg)[4:]  # equal, but a new decision
    assert tg.provider("k", a, [b], [], "unused", True) == "general path"
    tg._DECISIONS["k"] = cfg
    tg._PLANS[tg._plan_key("k", a, [b], [])] = Plan(None)  # declines this call
    assert tg.provider("k", a, [b], [], "unused", True) == "general path"


def test_direct_launch_steps_aside_when_triton_would_specialise_again(monkeypatch):
    """A kept plan's direct launch reuses one compiled kernel, so it runs only on tensors Triton
    would specialise the same way (dtype, 16-byte alignment) on the device it was captured on, and
    passes the constexprs after the call's arguments on the current stream, as JITFunction.run does."""
    import torch

    from torch_xaccel.codegen import triton_launch as tl_

    calls = []
    device = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1000 + d, raising=False)
    x = torch.randn(64, dtype=torch.bfloat16)
    direct = tl_.DirectLaunch(lambda *a, stream: calls.append((a, stream)), (128, 64), 0, tl_._guard([x]))
    assert direct.matches([torch.randn(32, dtype=torch.bfloat16)])  # other values and size, same class
    assert not direct.matches([x[1:]])  # 2 bytes off the 16-byte alignment
    assert not direct.matches([x.float()])
    device[0] = 1
    assert not direct.matches([x])
    device[0] = 0
    direct((x, 7))
    assert calls == [((x, 7, 128, 64), 1000)]
    # what the interpreter's launch returns (nothing compiled) is never captured
    assert tl_.DirectLaunch.capture(None, None, (1,), {}, 0, [x]) is None


def test_aten_decision_keeps_a_plan_only_while_it_stands(monkeypatch):
    """A case that tuning gave to ATen keeps a plan straight to the composition (its checks
    skipped on later calls), at any M, and the plan stops once the decision is gone (a retune)
    or CUTLASS builds are pending for the case."""
    import torch

    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as tg
    from torch_xaccel.ops.gemm_epilogue import reference as gemm_epilogue

    calls = []
    monkeypatch.setattr(gemm_epilogue, "aten_composition", lambda *a: calls.append(a[0].shape[0]) or "aten")
    monkeypatch.setattr(tg, "_int32_reach", lambda *a: True)
    monkeypatch.setattr(tg, "_DECISIONS", {"k": None, "big": None})  # keys name shapes in the runtime
    monkeypatch.setattr(tg, "_PENDING", {})
    monkeypatch.setattr(tg, "_PLANS", {})
    small, big, b = torch.randn(4, 8), torch.randn(tg.SMALL_M_ROWS + 1, 8), torch.randn(6, 8)
    assert tg.provider("k", small, [b], [], "ep", True) == "aten"
    plan = tg._PLANS[tg._plan_key("k", small, [b], [])]
    assert isinstance(plan, tg._AtenPlan) and plan.cfg is None
    monkeypatch.setattr(tg, "_int32_reach", lambda *a: pytest.fail("the plan skips the provider's checks"))
    assert tg.provider("k", small, [b], [], "ep", True) == "aten"
    monkeypatch.setattr(tg, "_int32_reach", lambda *a: True)
    assert tg.provider("big", big, [b], [], "ep", True) == "aten"
    assert isinstance(tg._PLANS[tg._plan_key("big", big, [b], [])], tg._AtenPlan)
    tg._PENDING["k"] = (float("inf"), [])  # builds pending: back through the checks
    checked = []
    monkeypatch.setattr(tg, "_int32_reach", lambda *a: checked.append(1) or True)
    assert tg.provider("k", small, [b], [], "ep", True) == "aten" and checked
    del tg._PENDING["k"]
    del tg._DECISIONS["k"]  # retune: the plan must not answer for a case without a decision

    def general_path(*a):
        raise LookupError("tuning")
    monkeypatch.setattr(tg, "_Case", general_path)
    with pytest.raises(LookupError):
        tg.provider("k", small, [b], [], "ep", True)
    assert calls == [4, 4, tg.SMALL_M_ROWS + 1, 4]


def test_decode_case_that_aten_wins_on_gpu_weighs_host_time(monkeypatch):
    """A decode-size case that ATen won on GPU time goes to the fastest config when that config's
    GPU + host time per call is lower, else stays with ATen; both host times go into the entry."""
    from torch_xaccel.codegen import tuning
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as tg

    host = {"aten": 0.060, "cfg": 0.025}
    monkeypatch.setattr(tuning, "host_ms", lambda fn: host[fn()])
    fast, slow = tg.DECODE[0], tg.DECODE[1]

    def decide(aten_gpu):
        timings = [["aten", aten_gpu, "GPU time"], [slow, 0.020, ""], [fast, 0.015, ""], [tg.DECODE[2], None, "no fit"]]
        steady = lambda cfg: (lambda: "cfg" if cfg == fast else "other")  # noqa: E731 - only `fast` may be timed
        return tg._with_host_time(aten_gpu, lambda: "aten", steady, timings), timings

    cfg, timings = decide(0.012)  # 0.015 + 0.025 < 0.012 + 0.060
    assert cfg == fast
    assert timings[-3:-1] == [["aten", 0.06, "host time per call"], [fast, 0.025, "host time per call"]]
    assert timings[-1][0] == "decided by" and "40.0 against ATen's 72.0 us" in timings[-1][2]  # the report's note
    host["cfg"] = 0.058  # the config's host cost eats its lead: 0.015 + 0.058 > 0.012 + 0.060
    cfg, timings = decide(0.012)
    assert cfg is None and timings[-1][0] != "decided by"
    assert tg._with_host_time(0.012, lambda: "aten", lambda cfg: None, [["aten", 0.012, ""]]) is None  # nothing built
