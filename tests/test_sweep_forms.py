"""The sweep's recurrent forms written step by step (torch_xaccel/sweep/forms.py): mlstm_recurrent
computes the parallel paper form's function, slstm_paper the slstm_loop form's, in float64; and
each, compiled with xaccel on the CPU at a tiny size, is as right as eager against a float64 run
(the sweep's own verdict, run._errors). What the backend replaced is reported, not required: where
it replaced nothing of a form's recurrence, the report must say why."""
import copy

import pytest
import torch

from torch_xaccel.report import Report, collect
from torch_xaccel.sweep import forms, run


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_mlstm_recurrent_is_the_parallel_paper_form_in_float64():
    """The recurrent form (m_0 = -inf, zero states) against the stabilized parallel form, same
    weights, at an odd length; gates spread wide so that the stabilizer and the normalizer's max
    both switch."""
    torch.manual_seed(0)
    d, nh = 24, 3
    dh = d // nh
    paper = forms.MLSTMPaper(d, nh, False).double()
    with torch.no_grad():
        paper.wi.weight.mul_(8)
        paper.wf.weight.mul_(8)
        paper.wi.bias.normal_(0, 2)
    rec = forms.MLSTMRecurrent(d, nh, False).double()
    with torch.no_grad():  # q, k, v columns of the fused projection: [NH, 3, DH]
        rec.qkv.weight.view(nh, 3, dh, d).copy_(
            torch.stack([w.weight.view(nh, dh, d) for w in (paper.wq, paper.wk, paper.wv)], dim=1))
        rec.gates.weight.copy_(torch.cat([paper.wi.weight, paper.wf.weight]))
        rec.gates.bias.copy_(torch.cat([paper.wi.bias, paper.wf.bias]))
        rec.proj.weight.copy_(paper.wo.weight)
    x = torch.randn(2, 37, d, dtype=torch.float64)
    want = paper(x)
    assert torch.isfinite(want).all()
    assert _rel(rec(x), want) < 1e-9
    # fp32_rec changes nothing in float64 (the compute dtype of fp64 is fp64)
    rec.fp32_rec = True
    assert _rel(rec(x), want) < 1e-9


def test_slstm_paper_is_the_slstm_loop_in_float64():
    """The same equations in another spelling (gates i, f, z, o of one Linear, R [NH, DH, 4 DH],
    a separate bias, the state a tuple): equal to SLSTMLoop holding the same weights."""
    torch.manual_seed(0)
    d, nh, B, S = 24, 3, 2, 19
    dh = d // nh
    loop = forms.SLSTMLoop(d, nh).double()
    with torch.no_grad():  # wide gates: the stabilizer switches between its two arguments
        loop.wi.weight.mul_(6)
        loop.wf.weight.mul_(6)
        loop.R.mul_(2)
    paper = forms.SLSTMPaper(d, nh).double()
    lins = (loop.wi, loop.wf, loop.wz, loop.wo)  # the paper form's gate order
    with torch.no_grad():
        paper.W.weight.view(nh, 4, dh, d).copy_(torch.stack([w.weight.view(nh, dh, d) for w in lins], dim=1))
        paper.b.copy_(torch.stack([w.bias.view(nh, dh) for w in lins], dim=1))
        paper.R.view(nh, dh, 4, dh).copy_(torch.stack([loop.R[g] for g in (1, 2, 0, 3)], dim=2))
        paper.proj.weight.copy_(loop.out.weight)
    x = torch.randn(B, S, d, dtype=torch.float64)
    want = loop(x)
    assert torch.isfinite(want).all()
    assert _rel(paper(x), want) < 1e-10
    # its forget bias starts open as the loop's does
    assert torch.equal(forms.SLSTMPaper(d, nh).b[:, 1].flatten(), torch.linspace(3.0, 6.0, d))


def test_the_grid_has_the_new_forms_at_each_level():
    for name in ("mlstm_recurrent", "slstm_paper"):
        assert name in forms.FORMS
        assert any(r["form"] == name for r in forms.grid(quick=True))
        assert any(r["form"] == name for r in forms.grid(cpu=True, quick=True))
        full = [r for r in forms.grid() if r["form"] == name]
        assert full and {r["mode"] for r in full} == {"fwd", "train"}
    # loops over time are unrolled by Dynamo: the recurrent mLSTM stays at short sequences
    assert max(r["size"]["S"] for r in forms.grid() if r["form"] == "mlstm_recurrent") <= 256


@pytest.mark.parametrize("form,dtype,S", [("mlstm_recurrent", "bf16/fp32rec", 32), ("mlstm_recurrent", "fp32", 16),
                                          ("slstm_paper", "bf16", 16), ("slstm_paper", "fp32", 16)])
def test_compiled_with_xaccel_on_the_cpu_is_as_right_as_eager(form, dtype, S):
    """The sweep's rule: the output's relative error against a float64 run at most 3x eager's own
    plus a floor. The sLSTM loop is found (one xaccel slstm per block). The recurrent mLSTM, written
    in the [B, S, NH, DH] layout, is not found yet (the region search grows through [B, NH, ...]
    tensors only), so the test only requires the report to say why wherever it is not."""
    row = dict(form=form, size=dict(d=64 if form.startswith("mlstm") else 32, nh=2, S=S, B=2), dtype=dtype,
               mode="fwd")
    model, (x,) = forms.build(row, "cpu")
    truth_model = copy.deepcopy(model).double()
    with torch.no_grad():
        truth, eager = truth_model(x.double()), model(x)
        torch._dynamo.reset()
        with collect() as graphs:
            got = torch.compile(model, backend="xaccel")(x)
    report = Report(graphs=graphs)
    err = run._errors(row, {"eager": {"out": eager}, "xaccel": {"out": got}, "reference": {"out": truth}},
                      "highest")
    assert err["wrong"] == [], (err["items"], str(report))
    counts = report.counts()
    family = form.split("_")[0]  # mlstm / slstm
    if form == "slstm_paper":
        assert counts["slstm"] == 2, str(report)  # one per block: the loop is found
    if not counts[family] + counts[f"{family}_step"]:
        assert any(fb.family == family for fb in report.fallbacks), str(report)
