"""transformers' xLSTMForCausalLM (small configs, random weights, no download) compiled with the
backend: with the xlstm package installed it runs the package's mLSTM block (substituted while
Dynamo traces); without it, its own in-file copy of the chunkwise, sequence and step kernels
(found and proven by the mLSTM pass). Either way every mLSTM is replaced, the mLSTM's inner
matmuls are not reported as GEMM fallbacks, and logits, states and gradients equal eager."""
import importlib
import importlib.util
import sys

import pytest
import torch

import torch_xaccel
from tests.helpers import rel_err
from torch_xaccel.report import Report

transformers = pytest.importorskip("transformers")
MODULE = "transformers.models.xlstm.modeling_xlstm"
TOL = 1e-4


@pytest.fixture(params=["xlstm present", "xlstm hidden"])
def modeling(request, monkeypatch):
    """transformers' xlstm module as a user gets it with the xlstm package, or without it: then
    its file imported afresh under another name (Dynamo looks functions up by module name),
    transformers' availability check answering no and `import xlstm` failing meanwhile."""
    if request.param == "xlstm present":
        pytest.importorskip("xlstm")
        mod = importlib.import_module(MODULE)
    else:
        name = MODULE + "_without_xlstm"
        spec = importlib.util.spec_from_file_location(name, importlib.util.find_spec(MODULE).origin)
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, mod)
        with monkeypatch.context() as during_import:
            during_import.setattr(transformers.utils, "is_xlstm_available", lambda: False)
            for k in [k for k in sys.modules if k == "xlstm" or k.startswith("xlstm.")]:
                during_import.delitem(sys.modules, k)
            during_import.setitem(sys.modules, "xlstm", None)  # import xlstm fails, as where it is not installed
            spec.loader.exec_module(mod)
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
        states = [t.clone() for layer in out.cache.rnn_state.values() for t in layer]
        return out.logits, states, m(nxt, cache=out.cache, use_cache=True).logits

    with torch.no_grad():
        want = run(model)
        got = run(torch.compile(model, backend="xaccel"))
    prefill, decode = (Report(graphs=[g]) for g in torch_xaccel.last_report().graphs[-2:])
    assert rel_err(got[0], want[0]) <= TOL and rel_err(got[2], want[2]) <= TOL
    assert max(rel_err(a, b) for a, b in zip(got[1], want[1])) <= TOL
    assert prefill.counts()["mlstm"] == 2, str(torch_xaccel.last_report())
    assert decode.counts()["mlstm_step"] == 2, str(torch_xaccel.last_report())


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
