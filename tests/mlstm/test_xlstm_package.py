"""Real code: the xlstm 2.0.6 package's xLSTMLarge in its native PyTorch configuration compiles
through the backend, its chunkwise mLSTM kernels become xaccel.mlstm (Dynamo traces them as the
op: lowering/mlstm/substitutions.py), and the model equals eager (fp32), also when S needs
padding; in bf16, where the package's own code raises, the compiled model runs."""
import pytest
import torch

import torch_xaccel
from tests.helpers import rel_err
from torch_xaccel.ops import mlstm as mlstm_op

xlstm_large = pytest.importorskip("xlstm.xlstm_large.model")


def _model(mode="inference"):
    # train mode needs return_last_states=True in xlstm 2.0.6 (else the layer unpacks h itself)
    cfg = xlstm_large.xLSTMLargeConfig(
        embedding_dim=128, num_heads=2, num_blocks=2, vocab_size=97, chunk_size=16, mode=mode,
        chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
        step_kernel="native", return_last_states=mode == "train")
    torch.manual_seed(0)
    model = xlstm_large.xLSTMLarge(cfg)
    return model.eval() if mode == "inference" else model


def _eager_and_compiled(model, tokens):
    """(eager output, compiled output, the compile's report), without autograd."""
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(tokens)
        got = torch.compile(model, backend="xaccel")(tokens)
    return want, got, torch_xaccel.last_report(1)


@pytest.mark.parametrize("S", [32, 37])
def test_xlstm_large_native_mlstm_replaced_and_equal_to_eager(S):
    want, got, report = _eager_and_compiled(_model(), torch.randint(0, 97, (2, S)))
    assert rel_err(got, want) <= 1e-5
    assert report.counts()["mlstm"] == 2, str(report)  # one per block
    assert all("substituted while Dynamo traced" in r.pattern for r in report.replacements if r.family == "mlstm")
    assert report.counts()["gemm_epilogue"] > 0
    assert not [f for f in report.fallbacks if f.family == "mlstm"], str(report)


def test_xlstm_large_native_bf16_runs_compiled_where_eager_raises():
    """The package's native chunkwise mixes fp32 gates into bf16 matmuls and raises eagerly; with
    xaccel the compiled bf16 model runs and stays close to the fp32 model with the same weights
    (bf16 rounding through 2 blocks and the head: within 2e-2 relative)."""
    model, tokens = _model(), torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        want = model(tokens)
        model = model.to(torch.bfloat16)
        with pytest.raises(RuntimeError):
            model(tokens)
        torch._dynamo.reset()
        got = torch.compile(model, backend="xaccel")(tokens)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) <= 2e-2
    report = torch_xaccel.last_report(1)
    assert report.counts()["mlstm"] == 2
    assert not any(r.note for r in report.replacements if r.op == "xaccel.mlstm")  # no backward: nothing kept


@pytest.mark.parametrize("backward_fusion", ["0", "1"])  # "1": the default where CUTLASS kernels run
def test_xlstm_large_native_train_step_equal_to_eager(monkeypatch, backward_fusion):
    """Training through xaccel.mlstm's own backward: logits within 1e-5 of eager, all gradients
    together within 1e-5, and every parameter's gradient within 5e-4 of the float64 model's or no
    more than 3x as far from it as eager float32's own. The input-gate biases' gradients are
    near-cancelling sums: there eager float32 itself is 0.8-2e-4 off float64 and either float32
    path 1e-4-3e-4, depending on the host CPU's summation order, so a bound between the two
    float32 paths would hold on one host and fail on another (a wrong gradient is off by O(1)).
    With backward fusion the backward graph's GEMM chains are fused too (GPU default with CUTLASS)."""
    monkeypatch.setenv("XACCEL_BACKWARD_FUSION", backward_fusion)
    model, tokens = _model("train"), torch.randint(0, 97, (2, 32))
    want = model(tokens)[0]
    want.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model64 = _model("train").double()
    model64(tokens)[0].square().mean().backward()
    grads64 = [p.grad for p in model64.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    # a training graph runs the mlstm that keeps its chunk states for the backward where the
    # kernels' backward reads them (CUDA); here on the CPU, say it does
    from torch_xaccel.codegen import mlstm as mlstm_kernels

    monkeypatch.setattr(mlstm_kernels, "backward_reads_kept_states", lambda *a: True)
    kept = []
    reference_saving = mlstm_op.op._reference_saving
    monkeypatch.setattr(mlstm_op.op, "_reference_saving", lambda *a: kept.append(1) or reference_saving(*a))
    got = torch.compile(model, backend="xaccel")(tokens)[0]
    got.float().square().mean().backward()
    assert rel_err(got, want) <= 1e-5
    report = torch_xaccel.last_report(1)
    assert report.counts()["mlstm"] == 2 and len(kept) == 2
    assert all("keeps its chunk states" in r.note for r in report.replacements if r.op == "xaccel.mlstm"), str(report)
    far = [(name, rel_err(p.grad.double(), g64), rel_err(g.double(), g64))
           for (name, p), g, g64 in zip(model.named_parameters(), grads, grads64)]
    assert all(mine <= max(5e-4, 3 * eager) for _, mine, eager in far), [f for f in far if f[1] > 5e-4]
    assert rel_err(torch.cat([p.grad.flatten() for p in model.parameters()]),
                   torch.cat([g.flatten() for g in grads])) <= 1e-5
    assert not [f for f in report.fallbacks if "backward" in str(f).lower()], str(report)
    fused = [r for r in report.replacements if r.op == "xaccel.gemm_epilogue" and "backward" in r.note]
    assert bool(fused) == (backward_fusion == "1"), str(report)


def test_xlstm_large_native_traces_library_code_when_mlstm_is_switched_off(monkeypatch):
    monkeypatch.setenv("XACCEL_PATTERNS", "gemm_epilogue")
    want, got, report = _eager_and_compiled(_model(), torch.randint(0, 97, (2, 32)))
    assert rel_err(got, want) <= 1e-5
    assert report.counts()["mlstm"] == 0, str(report)


@pytest.mark.gpu
def test_xlstm_large_native_on_cuda_runs_the_kernels_and_matches_eager(monkeypatch):
    monkeypatch.setenv("XACCEL_TUNE", "0")  # default configs: first-call tuning would take most of the test's time
    model, tokens = _model().cuda(), torch.randint(0, 97, (2, 64), device="cuda")
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(tokens)
        got = torch.compile(model, backend="xaccel")(tokens)
    assert rel_err(got, want) <= 1e-4
    assert torch_xaccel.last_report(1).counts()["mlstm"] == 2


def _block_stack():
    from xlstm import mLSTMBlockConfig, mLSTMLayerConfig, xLSTMBlockStack, xLSTMBlockStackConfig

    cfg = xLSTMBlockStackConfig(
        mlstm_block=mLSTMBlockConfig(mlstm=mLSTMLayerConfig(conv1d_kernel_size=4, qkv_proj_blocksize=4, num_heads=4)),
        context_length=48, num_blocks=2, embedding_dim=64, slstm_at=[])
    torch.manual_seed(0)
    return xLSTMBlockStack(cfg)


@pytest.mark.parametrize("S", [48, 30])  # the layer's own causal-mask buffer (S = context) or a fresh one
def test_xlstm_block_stack_mlstm_layer_replaced_equal_in_forward_and_gradients(S):
    """The older xLSTMBlockStack's mLSTM cell (parallel_stabilized_simple: [B, NH, S, 1] gates,
    torch.max, a cat/repeat decay matrix) runs as xaccel.mlstm, equal to eager in fp32."""
    model, x, w = _block_stack(), torch.randn(2, S, 64), torch.randn(2, S, 64)  # w: a random cotangent
    want = model(x)
    (want * w).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    got = torch.compile(model, backend="xaccel")(x)
    (got * w).sum().backward()
    assert rel_err(got, want) <= 1e-5
    assert torch_xaccel.last_report(1).counts()["mlstm"] == 2, str(torch_xaccel.last_report(1))
    assert rel_err(torch.cat([p.grad.flatten() for p in model.parameters()]),
                   torch.cat([g.flatten() for g in grads])) <= 1e-5


def _compiled_and_explained(model, x):
    """(eager output, compiled output, explain()'s report), without autograd."""
    torch._dynamo.reset()
    with torch.no_grad():
        return model(x), torch.compile(model, backend="xaccel")(x), torch_xaccel.explain(model, x)


def test_xlstm_block_stack_mlstm_without_a_kernel_is_left_as_written_with_the_reason(monkeypatch):
    """Where no kernel would run the layer (on a GPU: a head dim the kernels lack), the library's
    parallel_stabilized_simple runs as written (the op's chunkwise reference would be slower than
    it), and explain() says why. Simulated on CPU by a trace-time check that declines."""
    from torch_xaccel.lowering.mlstm import parallel, substitutions

    monkeypatch.setattr(substitutions, "_kernel_refusal", lambda device, q, k, v, DK, DV: f"no kernel for {DK}/{DV}")
    # the library's code, run as written, is the parallel form the structural walk knows: no kernel there either
    monkeypatch.setattr(parallel, "kernel_refusal", lambda q, k, v: f"no kernel for {q.shape[-1]}/{v.shape[-1]}")
    want, got, report = _compiled_and_explained(_block_stack().eval(), torch.randn(2, 48, 64))
    assert rel_err(got, want) <= 1e-6
    assert report.counts()["mlstm"] == 0
    assert any("parallel_stabilized_simple left as written: no kernel for 32/32" in b.reason
               for b in report.graph_breaks), [b.reason for b in report.graph_breaks]


def test_kernel_refusal_names_what_the_mlstm_kernels_lack_on_cuda():
    """Fake CUDA values (no GPU needed): head dim 768 (above the kernels' 512) has no kernel; 384
    (E768 with 4 heads and projection factor 2, as in xLSTMBlockStack) runs at 512 with masked
    columns, a power of two as it is; CPU values are never refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_xaccel.lowering.mlstm.matching import kernel_refusal

    with FakeTensorMode():
        too_wide, padded, fits = (torch.empty(2, 4, 64, d, device="cuda", dtype=torch.bfloat16)
                                  for d in (768, 384, 256))
    assert "head dims 768/768" in kernel_refusal(too_wide, too_wide, too_wide)
    assert kernel_refusal(padded, padded, padded) is None
    assert kernel_refusal(fits, fits, fits) is None
    cpu = torch.empty(2, 4, 64, 768)
    assert kernel_refusal(cpu, cpu, cpu) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_xlstm_block_stack_head_dim_384_on_cuda_runs_the_kernels(monkeypatch):
    """The bench's 7:1 stack's mLSTM (E768, 4 heads: head dim 384) on a GPU: the kernels run it
    at 512 with masked columns. The model in bf16, compiled, forward and backward, against the same
    (bf16-rounded) weights in fp32 eagerly: output within 1e-2, parameter gradients within 5e-2
    (tests/mlstm/test_triton_interpreter.py runs a padded head through this model in fp32)."""
    import copy

    from xlstm import mLSTMBlockConfig, mLSTMLayerConfig, xLSTMBlockStack, xLSTMBlockStackConfig

    from torch_xaccel.report import Report, collect

    cfg = xLSTMBlockStackConfig(
        mlstm_block=mLSTMBlockConfig(mlstm=mLSTMLayerConfig(conv1d_kernel_size=4, qkv_proj_blocksize=4, num_heads=4)),
        context_length=64, num_blocks=1, embedding_dim=768, slstm_at=[])
    torch.manual_seed(0)
    model = xLSTMBlockStack(cfg).cuda().bfloat16()
    ref = copy.deepcopy(model).float()
    x = torch.randn(2, 64, 768, device="cuda").bfloat16()
    w = torch.randn(2, 64, 768, device="cuda")  # a random cotangent (a square loss on the final LayerNorm's
    want = ref(x.float())                        # output sends it a gradient that cancels to ~0)
    (want * w).sum().backward()
    torch._dynamo.reset()
    with collect() as graphs:
        got = torch.compile(model, backend="xaccel")(x)
        (got.float() * w).sum().backward()
    assert Report(graphs).counts()["mlstm"] >= 1, str(Report(graphs))
    assert rel_err(got.float(), want) <= 1e-2
    errs = [rel_err(p.grad.float(), r.grad) for p, r in zip(model.parameters(), ref.parameters())]
    assert max(errs) <= 5e-2, errs


def test_xlstm_block_stack_runs_library_code_when_mlstm_is_switched_off(monkeypatch):
    monkeypatch.setenv("XACCEL_PATTERNS", "gemm_epilogue")
    model, x = _block_stack().eval(), torch.randn(2, 48, 64)
    torch._dynamo.reset()
    from torch_xaccel.report import Report, collect

    with torch.no_grad(), collect() as graphs:
        want = model(x)
        got = torch.compile(model, backend="xaccel")(x)
    assert rel_err(got, want) <= 1e-6
    assert graphs and Report(graphs=graphs).counts()["mlstm"] == 0


def test_substituted_parallel_form_refuses_a_mask_that_is_not_causal():
    """A mask argument the library would use as given must be lower-triangular: otherwise the
    compiled call raises instead of silently computing the causal result."""
    from xlstm.blocks.mlstm.backends import parallel_stabilized_simple

    S = 16
    x = [torch.randn(1, 2, S, 8) for _ in range(3)] + [torch.randn(1, 2, S, 1), torch.randn(1, 2, S, 1) + 2]
    fn = torch.compile(lambda *a, mask: parallel_stabilized_simple(*a, lower_triangular_matrix=mask), backend="xaccel")
    torch._dynamo.reset()
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    assert rel_err(fn(*x, mask=causal), parallel_stabilized_simple(*x, lower_triangular_matrix=causal)) <= 1e-5
    with pytest.raises(RuntimeError, match="not lower-triangular"):
        fn(*x, mask=torch.ones(S, S, dtype=torch.bool))


def test_xlstm_large_native_decode_steps_replaced_and_equal_to_eager():
    """Inference with states: prefill, then one-token steps. xLSTMLarge writes each new state back
    into the old tensors (copy_), which the step pass sees through same-dtype casts of its inputs;
    every step becomes xaccel.mlstm_step; logits and states equal eager (fp32)."""
    cfg = xlstm_large.xLSTMLargeConfig(
        embedding_dim=128, num_heads=2, num_blocks=2, vocab_size=97, chunk_size=16, mode="inference",
        chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
        step_kernel="native", return_last_states=True)
    torch.manual_seed(0)
    model = xlstm_large.xLSTMLarge(cfg).eval()
    prompt, steps = torch.randint(0, 97, (2, 32)), torch.randint(0, 97, (2, 3))
    clone = lambda st: {b: tuple(t.clone() for t in s) for b, s in st.items()}  # noqa: E731 - the model writes states in place
    torch._dynamo.reset()
    fn = torch.compile(model, backend="xaccel")
    with torch.no_grad():
        _, want_state = model(prompt)
        _, got_state = fn(prompt)
        for t in range(steps.shape[1]):
            want, want_state = model(steps[:, t:t + 1], clone(want_state))
            got, got_state = fn(steps[:, t:t + 1], clone(got_state))
            assert torch_xaccel.last_report(1).counts()["mlstm_step"] == 2, str(torch_xaccel.last_report(1))
            assert rel_err(got, want) <= 1e-5
    for b in want_state:
        for g, w in zip(got_state[b], want_state[b]):
            assert rel_err(g, w) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("fallback", ["eager", "inductor"])
def test_xlstm_large_decode_under_reduce_overhead_equal_to_eager(monkeypatch, fallback):
    """torch.compile(..., backend="xaccel", mode="reduce-overhead"): decode steps run under CUDA
    graph trees (eager rest: the lowered graph, whose in-place state writes aot_autograd moves
    out of the graph; Inductor rest: Inductor's own graphs), still as xaccel.mlstm_step, and
    equal eager fp32 step after step with the state fed back."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("XACCEL_FALLBACK", fallback)
    cfg = xlstm_large.xLSTMLargeConfig(
        embedding_dim=128, num_heads=2, num_blocks=2, vocab_size=97, chunk_size=16, mode="inference",
        chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
        step_kernel="native", return_last_states=True)
    torch.manual_seed(0)
    model = xlstm_large.xLSTMLarge(cfg).eval().cuda()
    prompt, steps = torch.randint(0, 97, (2, 32), device="cuda"), torch.randint(0, 97, (2, 5), device="cuda")
    clone = lambda st: {b: tuple(t.clone() for t in s) for b, s in st.items()}  # noqa: E731 - the model writes states in place
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(model, backend="xaccel", mode="reduce-overhead")
    with torch.no_grad():
        _, want_state = model(prompt)
        got_state = clone(want_state)
        for t in range(steps.shape[1]):  # graph trees: warm-up, record, then replays
            want, want_state = model(steps[:, t:t + 1], clone(want_state))
            got, got_state = fn(steps[:, t:t + 1], clone(got_state))
            assert rel_err(got, want) <= 1e-4, t
    assert torch_xaccel.last_report(1).counts()["mlstm_step"] == 2
    for b in want_state:
        for g, w in zip(got_state[b], want_state[b]):
            assert rel_err(g, w) <= 1e-4
    if fallback == "eager":
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        # the weights stay in place (graphed_rest.py): per recording only the token and the 6
        # state tensors are copied in (torch's cudagraphs backend copies all 40 inputs)
        assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] <= 14, dict(counters["inductor"])
    print("cudagraph skips", fallback, dict(counters["inductor"]))


@pytest.mark.gpu
def test_xlstm_large_native_bf16_on_cuda_runs_through_the_kernels(monkeypatch):
    """The issue's case: bf16 native configuration, which raises eagerly, compiled with xaccel on
    CUDA (mLSTM and GEMM kernels): within 2e-2 of the fp32 model with the same (bf16-rounded)
    weights, so that the bound is on the bf16 computation, not the weights' rounding (against
    unrounded fp32 weights, the error would be weight rounding plus bf16 activations)."""
    monkeypatch.setenv("XACCEL_TUNE", "0")  # the default configs (every candidate has its own GPU test)
    model, tokens = _model().cuda(), torch.randint(0, 97, (2, 64), device="cuda")
    with torch.no_grad():
        model = model.to(torch.bfloat16).float()
        want = model(tokens)
        model = model.to(torch.bfloat16)
        torch._dynamo.reset()
        got = torch.compile(model, backend="xaccel")(tokens)
    assert rel_err(got, want) <= 2e-2
    assert torch_xaccel.last_report(1).counts()["mlstm"] == 2
