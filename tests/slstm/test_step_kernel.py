"""The generated Triton step kernel of xaccel::slstm_step (codegen/slstm/triton_step.py).

Under Triton's interpreter (CPU, fp32), against the reference step in fp64 within 1e-5 relative:
every variant (fresh rule x clamped gates x clamped n), partly fresh states, batch sizes that do
not fill a tile, the head shapes the issue names (small batches for the large heads), odd head
dims (masked tiles), strided Wx, mixed input and state dtypes, the batch fresh rule decided on
the device when only another batch tile holds a non-zero n, every candidate configuration's tiles,
and the op dispatching to the kernel. On the GPU (@gpu): bf16 / fp16 against the fp32 reference
within 1e-2, fp32 within 1e-5 (3xTF32 dots at torch's default "highest"), every tuning candidate, tuning itself, and a
CUDA-graph capture replayed on new inputs."""
import textwrap

import pytest
import torch

from tests.helpers import interpret
from torch_xaccel.ops.slstm import reference

pytest.importorskip("triton")

VARIANTS = [(fresh, cg, cn) for fresh in ("element", "batch") for cg in (False, True) for cn in (False, True)]
SHAPES = [(4, 192), (1, 768), (4, 256), (8, 128), (12, 64)]

# shared by the interpreter scripts: inputs with partly fresh states, and the comparison
COMMON = textwrap.dedent("""
    import os, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from torch_xaccel.codegen.slstm import triton_step
    from torch_xaccel.ops.slstm import reference
    torch.manual_seed(0)
    bad = 0

    def inputs(B, NH, D, zero_rows=(0,), dtype=torch.float32, T=None):
        Wx = torch.randn(B, 4, NH, D) if T is None else torch.randn(B, T, 4, NH, D)[:, T // 2]
        R = torch.randn(NH, 4, D, D) / D ** 0.5
        b = torch.randn(4, NH, D)
        h, c, m = (torch.randn(B, NH, D) for _ in range(3))
        n = torch.rand(B, NH, D) + 0.2
        for r in zero_rows:
            n[r] = 0  # fresh rows: the two fresh rules differ here
        return [Wx.to(dtype), R.to(dtype), b, h, c, n, m]

    def errors(got, x, variant):
        # relative errors against the fp64 reference (h rounded to Wx's dtype first, as the op
        # rounds it) over the finite entries; inf where the NaNs sit elsewhere
        Wx, R, b, h, c, n, m = x
        want = reference.step(*(t.double() for t in (Wx, R, b, h.to(Wx.dtype), c, n, m)), *variant)
        assert all(g.dtype == torch.float32 and g.shape == w.shape and g.is_contiguous() for g, w in zip(got, want))
        errs = []
        for g, w in zip(got, want):
            g, finite = g.double(), w.isfinite()
            same_nans = torch.equal(g.isnan(), w.isnan())
            errs.append(((g - w)[finite].norm() / w[finite].norm()).item() if same_nans else float("inf"))
        return errs

    def check(label, got, x, variant, tol=1e-5):
        global bad
        errs = errors(got, x, variant)
        ok = all(e <= tol for e in errs)  # NaN fails too
        print(label, variant, " ".join(f"{e:.1e}" for e in errs), "ok" if ok else "FAIL")
        bad += not ok
""")


def _run(body: str, tmp_path) -> str:
    return interpret(COMMON + textwrap.dedent(body) + "\nraise SystemExit(bad)\n", tmp_path)


def test_every_variant_and_head_shape_in_interpreter(tmp_path):
    """Every variant on a 4 x 192 head with B = 19 (two batch tiles, the second partly filled) and
    rows 0 and 17 fresh; the other head shapes at small B, each variant once among them."""
    out = _run(f"""
        for variant in {VARIANTS!r}:
            x = inputs(19, 2, 48, zero_rows=(0, 17))
            check("B19 NH2 D48", triton_step.step(None, *x, *variant), x, variant)
        for (NH, D), B, variant in zip({SHAPES!r} * 2, (3, 2, 2, 5, 17) * 2, {VARIANTS!r}):
            x = inputs(B, NH, D, zero_rows=(1,))
            check(f"B{{B}} NH{{NH}} D{{D}}", triton_step.step(None, *x, *variant), x, variant)
    """, tmp_path)
    assert out.count(" ok") == 2 * len(VARIANTS), out


def test_batch_fresh_rule_decided_across_tiles_in_interpreter(tmp_path):
    """The batch rule sees the whole batch: a tile whose own n is all zero is not fresh when another
    tile (or another head) holds a non-zero or NaN n, and all rows are fresh when n == 0
    everywhere. The element rule's result differs there, so a swapped rule would fail."""
    out = _run("""
        B, NH, D = 37, 2, 32  # tiles of 16 rows: the last two see n == 0 in their own rows
        for case in ("other tile", "other head", "nan", "all zero"):
            x = inputs(B, NH, D, zero_rows=range(16, B))
            n = x[5]
            if case == "other head":
                n[:16, 0] = 0
                n[3, 1, 5] = 0.7
            elif case == "nan":
                n[:16] = 0
                n[2, 0, 1] = float("nan")
            elif case == "all zero":
                n.zero_()
            for variant in (("batch", False, False), ("batch", True, True)):
                got = triton_step.step(None, *x, *variant)
                check(case, got, x, variant)
                if case != "all zero" and max(errors(got, x, ("element",) + variant[1:])) < 1e-3:
                    print("FAIL: the element rule gives the same result", case)
                    bad += 1
        x = inputs(B, NH, D, zero_rows=(0, 20))
        check("element", triton_step.step(None, *x, "element", False, True), x, ("element", False, True))
    """, tmp_path)
    assert out.count(" ok") == 9, out


def test_strides_dtypes_and_configs_in_interpreter(tmp_path):
    """Wx as a slice of [B, T, 4, NH, D] and as a permuted view (read in place); fp16 Wx and R
    (16-bit products in the fp32 accumulator), fp32 Wx with fp16 R and fp16 / fp64 states (fp32
    dots, converted as the reference converts); every tuning candidate's tiles, whether or not
    they divide D; cases the kernel leaves to the reference."""
    out = _run("""
        x = inputs(5, 4, 64, T=7)
        assert x[0].stride(0) == 7 * 4 * 4 * 64
        check("time slice", triton_step.step(None, *x, "batch", True, False), x, ("batch", True, False))
        x = inputs(5, 4, 64)
        x[0] = x[0].permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)  # gates outermost in memory
        check("permuted", triton_step.step(None, *x, "element", True, True), x, ("element", True, True))
        x = inputs(6, 2, 64, dtype=torch.float16)
        check("fp16", triton_step.step(None, *x, "element", False, False), x, ("element", False, False))
        x = inputs(6, 2, 64)
        x[1] = x[1].half()
        x[3], x[4] = x[3].half(), x[4].double()
        x[5] = x[5].double()
        check("mixed", triton_step.step(None, *x, "batch", False, True), x, ("batch", False, True))
        seen = set()
        for NH, D, B in ((2, 192, 3), (1, 24, 70), (1, 256, 40)):
            x = inputs(B, NH, D, zero_rows=(1,))
            for cfg in triton_step.candidates(B, D) + [triton_step.default(B, D)]:
                tiles = (cfg["BB"], cfg["BJ"], cfg["BK"])
                seen.add(tiles)
                got = triton_step.launch(cfg, *[t.contiguous() for t in x], "element", True, False)
                check(f"NH{NH} D{D} B{B} {tiles}", got, x, ("element", True, False))
        print(sorted(seen))
        x = inputs(3, 2, 16)
        bf16 = [t.bfloat16() if i < 2 else t for i, t in enumerate(x)]
        declined = [triton_step.step(None, *(t.double() for t in x), "element", False, False),  # fp64: the reference
                    triton_step.step(None, *bf16, "element", False, False),  # bf16: not in the interpreter
                    triton_step.step(None, *x[:3], x[3][:1], *x[4:], "element", False, False),  # a broadcast state
                    triton_step.step(None, *(t[:0] if i == 0 or i > 2 else t for i, t in enumerate(x)),
                                     "element", False, False)]  # B == 0
        print("declined", [d is NotImplemented for d in declined])
        bad += not all(d is NotImplemented for d in declined)
    """, tmp_path)
    assert "FAIL" not in out and out.count(" ok") >= 4 + 6, out


def test_op_runs_the_kernel_in_interpreter(tmp_path):
    """torch.ops.xaccel.slstm_step on CPU tensors under the interpreter takes the kernel (the
    runtime records its choice, no fallback event), and the rendered module is written through
    the kernel cache (XACCEL_CACHE_DIR/kernels)."""
    out = _run("""
        from torch_xaccel import runtime
        x = inputs(9, 4, 32, zero_rows=(2,))
        got = torch.ops.xaccel.slstm_step(*x, "batch", True, False)
        check("op", got, x, ("batch", True, False))
        choices = [v for v in runtime.CHOICES.values() if v[0] == "slstm_step"]
        print("choices", choices, "events", runtime.EVENTS)
        bad += len(choices) != 1 or bool(runtime.EVENTS)
        from torch_xaccel.codegen import cache
        files = sorted((cache.root() / "kernels").glob("slstm_step_*.py"))
        bad += len(files) != 1 or "xaccel::slstm_step" not in files[0].read_text()
        print("kernels", [f.name for f in files])
    """, tmp_path)
    assert "op" in out and "FAIL" not in out, out


# ---- on the GPU -----------------------------------------------------------------------------

def _cuda_inputs(B, NH, D, dtype, seed=0, zero_rows=(0,)):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Wx = torch.randn(B, 4, NH, D, device="cuda", generator=g).to(dtype)
    R = (torch.randn(NH, 4, D, D, device="cuda", generator=g) / D ** 0.5).to(dtype)
    b = torch.randn(4, NH, D, device="cuda", generator=g)
    h, c, m = (torch.randn(B, NH, D, device="cuda", generator=g) for _ in range(3))
    n = torch.rand(B, NH, D, device="cuda", generator=g) + 0.2
    for r in zero_rows:
        if r < B:
            n[r] = 0
    return [Wx, R, b, h, c, n, m]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _kernel_step(x, variant):
    """The op's result, asserting that the kernel ran (its choice recorded, no fallback)."""
    from torch_xaccel import runtime

    events = len(runtime.EVENTS)
    got = torch.ops.xaccel.slstm_step(*x, *variant)
    assert len(runtime.EVENTS) == events, runtime.EVENTS[-1]
    assert any(v[0] == "slstm_step" for v in runtime.CHOICES.values())
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("NH,D", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_step_matches_reference(NH, D, dtype, monkeypatch):
    monkeypatch.setenv("XACCEL_TUNE", "0")  # the untimed config; every candidate has its own test
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for B, variant in zip((1, 7, 33, 64), VARIANTS[::2] if D % 128 else VARIANTS[1::2]):
        x = _cuda_inputs(B, NH, D, dtype, seed=B, zero_rows=(0, B - 1))
        got = _kernel_step(x, variant)
        want = reference.step(*x, *variant)  # fp32 state math, R and h as the kernel rounds them
        for g, w in zip(got, want):
            assert g.dtype == torch.float32 and _rel(g, w) <= tol, (B, variant, _rel(g, w))


@pytest.mark.gpu
def test_gpu_batch_fresh_rule_across_tiles(monkeypatch):
    monkeypatch.setenv("XACCEL_TUNE", "0")
    x = _cuda_inputs(37, 4, 192, torch.bfloat16, zero_rows=range(16, 37))
    for n_case in ("other tile", "all zero"):
        if n_case == "all zero":
            x[5].zero_()
        for variant in (("batch", True, False), ("batch", False, True)):
            got = _kernel_step(x, variant)
            for g, w in zip(got, reference.step(*x, *variant)):
                assert _rel(g, w) <= 1e-2, (n_case, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("NH,D", [(4, 192), (1, 768), (12, 64)])
def test_gpu_every_candidate(NH, D):
    from torch_xaccel.codegen.slstm import triton_step

    for B in (3, 40):
        x = _cuda_inputs(B, NH, D, torch.bfloat16, seed=B)
        want = reference.step(*x, "element", True, True)
        for cfg in triton_step.candidates(B, D):
            got = triton_step.launch(cfg, *x, "element", True, True)
            for g, w in zip(got, want):
                assert _rel(g, w) <= 1e-2, cfg


@pytest.mark.gpu
def test_gpu_tuning_decides_and_records(tmp_path, monkeypatch):
    from torch_xaccel import runtime
    from torch_xaccel.codegen.slstm import triton_step

    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_step, "_CHOSEN", {})
    monkeypatch.setattr(triton_step, "_DECISIONS", {})
    x = _cuda_inputs(8, 8, 128, torch.bfloat16)
    got = triton_step.step("tuned-case", *x, "batch", True, False)
    cfg = triton_step._CHOSEN[("tuned-case", torch.bfloat16, torch.bfloat16, x[0].device, 8, 8, 128)]
    assert cfg in triton_step.candidates(8, 128)
    assert runtime.CHOICES["tuned-case"][0] == "slstm_step"
    assert list((tmp_path / "tuning").glob("*.json"))  # stored for later processes
    for g, w in zip(got, reference.step(*x, "batch", True, False)):
        assert _rel(g, w) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fresh", ["element", "batch"])
def test_gpu_cuda_graph_capture_and_replay(fresh):
    """A captured step replays on new inputs copied into its static buffers: the batch rule's
    device-side decision follows n at replay (fresh at first, not after), no host sync inside."""
    variant = (fresh, True, True)
    x = _cuda_inputs(5, 4, 192, torch.bfloat16, zero_rows=())
    x[5].zero_()  # a zero start: every row fresh
    static = [t.clone() for t in x]
    torch.ops.xaccel.slstm_step(*static, *variant)  # tune and compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = torch.ops.xaccel.slstm_step(*static, *variant)
    for step in range(3):
        fresh_inputs = _cuda_inputs(5, 4, 192, torch.bfloat16, seed=10 + step, zero_rows=())
        fresh_inputs[1:3] = x[1:3]  # the weights stay
        if step == 0:
            fresh_inputs[5].zero_()
        for s, t in zip(static, fresh_inputs):
            s.copy_(t)
        graph.replay()
        want = reference.step(*fresh_inputs, *variant)
        for g, w in zip(outs, want):
            assert _rel(g, w) <= 1e-2, (step, _rel(g, w))

