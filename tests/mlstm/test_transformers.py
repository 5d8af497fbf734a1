"""transformers' xLSTMForCausalLM (small configs, random weights, no download) compiled with the
backend: with the xlstm package installed it runs the package's mLSTM block (substituted while
Dynamo traces); without it, its own in-file copy of the chunkwise, sequence and step kernels
(found and proven by the mLSTM pass). Either way every mLSTM is replaced, the mLSTM's inner
matmuls are not reported as GEMM fallbacks, and logits, states and gradients equal eager."""
import copy
import importlib

import pytest
import torch
import torch.nn.functional as F

import torch_xaccel
from tests.helpers import rel_err
from torch_xaccel.bench.model import transformers_cache, transformers_cache_of, transformers_xlstm_without_package
from torch_xaccel.report import Report, collect

transformers = pytest.importorskip("transformers")
MODULE = "transformers.models.xlstm.modeling_xlstm"
TOL = 1e-4


@pytest.fixture(params=["xlstm present", "xlstm hidden"])
def modeling(request):
    """transformers' xlstm module as a user gets it with the xlstm package, or without it (its own
    in-file copy of the kernels; bench.model.transformers_xlstm_without_package)."""
    if request.param == "xlstm present":
        pytest.importorskip("xlstm")
        mod = importlib.import_module(MODULE)
    else:
        mod = transformers_xlstm_without_package()
    assert mod.external_xlstm == (request.param == "xlstm present")
    return mod


def _model(modeling, mode="inference", qk=0.5, blocks=2):
    cfg = transformers.xLSTMConfig(vocab_size=97, hidden_size=64, num_heads=2, num_blocks=blocks, qk_dim_factor=qk,
                                   v_dim_factor=1.0, chunk_size=16, mode=mode, use_cache=False)
    torch.manual_seed(0)
    return modeling.xLSTMForCausalLM(cfg)


def _no_inner_gemm_fallbacks(report) -> bool:
    return not [fb for fb in report.fallbacks if fb.family == "gemm_epilogue" and "operand ranks" in fb.reason]


@pytest.mark.parametrize("S", [32, 37])
def test_prefill_replaces_every_mlstm(modeling, S):
    """S 37: 32 positions chunkwise, 5 by the recurrent sequence kernel (hidden) or padding
    (present); the chunkwise part and the steps after it become one xaccel.mlstm."""
    model = _model(modeling).eval()
    tokens = torch.randint(0, 97, (2, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits
        got = torch.compile(model, backend="xaccel")(tokens).logits
    report = torch_xaccel.last_report()
    assert rel_err(got, want) <= TOL
    assert report.counts()["mlstm"] == 2 and report.counts()["mlstm_step"] == 0, str(report)
    assert _no_inner_gemm_fallbacks(report), str(report)
    assert not [fb for fb in report.fallbacks if fb.family == "mlstm"], str(report)


def test_prefill_then_decode_through_the_cache(modeling):
    """use_cache=True: the prefill's final states (extra outputs of xaccel.mlstm) fill transformers'
    cache, and the one-token decode step reads it (xaccel.mlstm_step): states and logits equal."""
    model = _model(modeling, qk=1.0).eval()
    g = torch.Generator().manual_seed(2)
    tokens, nxt = torch.randint(0, 97, (2, 21), generator=g), torch.randint(0, 97, (2, 1), generator=g)

    def run(m):
        out = m(tokens, use_cache=True)
        cache = transformers_cache_of(out)
        states = [t.clone() for layer in cache.rnn_state.values() for t in layer]
        return out.logits, states, m(nxt, use_cache=True, **transformers_cache(modeling, cache)).logits

    with torch.no_grad():
        want = run(model)
        got = run(torch.compile(model, backend="xaccel"))
    prefill, decode = (Report(graphs=[g]) for g in torch_xaccel.last_report().graphs[-2:])
    assert rel_err(got[0], want[0]) <= TOL and rel_err(got[2], want[2]) <= TOL
    assert max(rel_err(a, b) for a, b in zip(got[1], want[1])) <= TOL
    assert prefill.counts()["mlstm"] == 2, str(torch_xaccel.last_report())
    assert decode.counts()["mlstm_step"] == 2, str(torch_xaccel.last_report())


def test_bench_cache_copy_holds_the_same_states_in_new_memory(modeling):
    """bench.model.transformers_cache_copy (reduce-overhead decode rows): the cache's states move out of
    the prefill's output memory, and decoding from the copy gives the original's logits."""
    from torch_xaccel.bench.model import transformers_cache_copy

    model = _model(modeling, qk=1.0).eval()
    g = torch.Generator().manual_seed(5)
    tokens, nxt = torch.randint(0, 97, (2, 13), generator=g), torch.randint(0, 97, (2, 1), generator=g)
    with torch.no_grad():
        want_cache = transformers_cache_of(model(tokens, use_cache=True))
        before = {layer: [t.data_ptr() for t in state] for layer, state in want_cache.rnn_state.items()}
        want_states = [t.clone() for state in want_cache.rnn_state.values() for t in state]
        cache = transformers_cache_copy(want_cache)
        assert all(t.data_ptr() not in before[layer] for layer, state in cache.rnn_state.items() for t in state)
        assert all(torch.equal(a, b) for a, b in zip(want_states, [t for st in cache.rnn_state.values() for t in st]))
        got = model(nxt, use_cache=True, **transformers_cache(modeling, cache)).logits
        fresh = transformers_cache_of(model(tokens, use_cache=True))
        want = model(nxt, use_cache=True, **transformers_cache(modeling, fresh)).logits
    assert torch.equal(got, want)


def test_training_gradients_equal_eager(modeling):
    model = _model(modeling, mode="train").train()
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(4))

    def grads(m):
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(tokens).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want = grads(model)
    got = grads(torch.compile(model, backend="xaccel"))
    report = torch_xaccel.last_report()
    assert rel_err(got[0], want[0]) <= TOL and len(got[1]) == len(want[1])
    assert max(rel_err(a, b) for a, b in zip(got[1], want[1])) <= TOL
    assert report.counts()["mlstm"] == 2, str(report)
    assert _no_inner_gemm_fallbacks(report), str(report)


def test_bf16_model_is_proven_in_fp32_and_replaced(modeling):
    """A bf16 model's mLSTM (bf16 buffers and casts inside) is proven with its math in fp32 and
    replaced; the op computes in fp32, so the logits stay near the fp32 model's."""
    model = _model(modeling, mode="train").eval()
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        truth = model(tokens).logits
        model.to(torch.bfloat16)
        got = torch.compile(model, backend="xaccel")(tokens).logits
    report = torch_xaccel.last_report()
    assert report.counts()["mlstm"] == 2, str(report)
    assert rel_err(got, truth) <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_cuda_runs_the_kernels_within_the_mlstm_tolerances(modeling, monkeypatch):
    """A bf16 model on CUDA compiled (the mLSTM kernels, chunkwise and step): prefill through the
    cache, a decode step and a train step against the same (bf16-rounded) weights in fp32 eagerly.
    Each quantity may be off the fp32 truth by max(floor, 2x eager bf16's own error): logits and
    states floor 1e-2, parameter gradients 5e-2. Eager bf16 is the yardstick because the cache
    holds exponentially weighted sums of bf16-rounded gates (eager itself is ~3e-2 off in C, n)."""
    monkeypatch.setenv("XACCEL_TUNE", "0")  # default configs: first-call tuning would take most of the test's time
    cfg = transformers.xLSTMConfig(vocab_size=97, hidden_size=256, num_heads=4, num_blocks=2, chunk_size=64,
                                   mode="inference", use_cache=True)
    torch.manual_seed(0)
    model = modeling.xLSTMForCausalLM(cfg).cuda().bfloat16().eval()
    ref = copy.deepcopy(model).float()
    g = torch.Generator(device="cuda").manual_seed(6)
    tokens, nxt = (torch.randint(0, 97, shape, device="cuda", generator=g) for shape in ((2, 128), (2, 1)))

    def prefill_and_step(m):
        out = m(tokens, use_cache=True)
        cache = transformers_cache_of(out)
        states = [t.float().clone() for layer in cache.rnn_state.values() for t in layer]
        return [out.logits.float(), m(nxt, use_cache=True, **transformers_cache(modeling, cache)).logits.float()] \
            + states

    torch._dynamo.reset()
    with torch.no_grad():
        want, eager = prefill_and_step(ref), prefill_and_step(model)
        with collect() as graphs:
            got = prefill_and_step(torch.compile(model, backend="xaccel"))
    counts = Report(graphs).counts()
    assert counts["mlstm"] == 2 and counts["mlstm_step"] == 2, str(Report(graphs))
    _within_twice_eager("inference (logits, decode logits, states)", got, eager, want, floor=1e-2)

    for m in (model, ref):
        m.config.mode = "train"
        m.train()
    labels = torch.randint(0, 97, (2, 128), device="cuda", generator=g)

    def grads(m, params):
        for p in params:
            p.grad = None
        F.cross_entropy(m(tokens, use_cache=False).logits.float().flatten(0, 1), labels.flatten()).backward()
        return [p.grad.float().clone() for p in params if p.grad is not None]

    torch._dynamo.reset()
    want = grads(ref, list(ref.parameters()))
    try:
        eager = grads(model, list(model.parameters()))
    except RuntimeError:  # the xlstm package's native chunkwise mixes fp32 and bf16 in training
        eager = None
    with collect() as graphs:
        got = grads(torch.compile(model, backend="xaccel"), list(model.parameters()))
    assert Report(graphs).counts()["mlstm"] == 2, str(Report(graphs))
    assert len(got) == len(want) > 0
    _within_twice_eager("parameter gradients", got, eager, want, floor=5e-2)


def _within_twice_eager(what, got, eager, want, floor):
    """eager None: eager bf16 does not run; the floor alone bounds."""
    theirs = [0.0] * len(want) if eager is None else [rel_err(e, t) for e, t in zip(eager, want, strict=True)]
    errs = [(rel_err(a, t), e) for a, t, e in zip(got, want, theirs, strict=True)]
    bad = [(i, f"{ours:.2e}", f"{theirs:.2e}") for i, (ours, theirs) in enumerate(errs)
           if not ours <= max(floor, 2 * theirs)]
    assert not bad, f"{what}: (index, xaccel error, eager bf16 error) over the bound: {bad}; all: {errs}"
