"""The sweep harness (torch_xaccel/sweep): its model forms compute what their equations say (the
three mLSTM forms one function, the sLSTM loop its recurrence), its rows list, the correctness
verdict, and one tiny CPU row end to end through the row subprocess."""
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from torch_xaccel.sweep import forms, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _paper_mixer_and_copies(d=24, nh=3, L=5):
    """An MLSTMPaper mixer in float64 and the einsum and chunkwise mixers holding its weights."""
    torch.manual_seed(0)
    paper = forms.MLSTMPaper(d, nh, False).double()
    with torch.no_grad():  # gates spread wide: the stabilizer and the normalizer's max both switch
        paper.wi.weight.mul_(8)
        paper.wf.weight.mul_(8)
        paper.wi.bias.normal_(0, 2)
    es = forms.MLSTMEinsum(d, nh, False).double()
    ch = forms.MLSTMChunkwise(d, nh, False, chunk=L).double()
    dh = d // nh
    with torch.no_grad():
        es.w_qkv.copy_(torch.stack([w.weight.view(nh, dh, d) for w in (paper.wq, paper.wk, paper.wv)]))
        es.w_gates.copy_(torch.stack([paper.wi.weight, paper.wf.weight]))
        es.b_gates.copy_(torch.stack([paper.wi.bias, paper.wf.bias]))
        es.w_out.copy_(paper.wo.weight.view(d, nh, dh))
        ch.proj.weight.copy_(torch.cat([paper.wq.weight, paper.wk.weight, paper.wv.weight, paper.wi.weight,
                                        paper.wf.weight]))
        ch.proj.bias.copy_(torch.cat([torch.zeros(3 * d, dtype=torch.float64), paper.wi.bias, paper.wf.bias]))
        ch.out.weight.copy_(paper.wo.weight)
    return paper, es, ch


def test_the_three_mlstm_forms_compute_one_function_in_float64():
    """Chunkwise (chunks of 5 over 23 positions: a partial last chunk) and einsum against the
    paper's stabilized parallel form, same weights, float64."""
    paper, es, ch = _paper_mixer_and_copies()
    x = torch.randn(2, 23, 24, dtype=torch.float64)
    want = paper(x)
    assert torch.isfinite(want).all()
    for got in (es(x), ch(x)):
        assert ((got - want).norm() / want.norm()).item() < 1e-12


def test_chunkwise_equals_the_parallel_form_for_any_chunk_size():
    torch.manual_seed(1)
    B, NH, S, DH = 2, 2, 40, 8
    q, k, v = (torch.randn(B, NH, S, DH, dtype=torch.float64) for _ in range(3))
    i, f = torch.randn(B, NH, S, dtype=torch.float64) * 4, torch.randn(B, NH, S, dtype=torch.float64) * 3 + 1
    logf = F.logsigmoid(f).cumsum(-1)
    logD = (logf[..., :, None] - logf[..., None, :] + i[..., None, :]).masked_fill(
        ~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    m = logD.amax(-1, keepdim=True)
    C = (q @ k.transpose(-1, -2) / math.sqrt(DH)) * torch.exp(logD - m)
    want = (C / (torch.maximum(C.sum(-1, keepdim=True).abs(), torch.exp(-m)) + 1e-6)) @ v
    for L in (1, 7, 16, 40, 64):
        got = forms.mlstm_chunkwise(q, k, v, i, f, L)
        assert (got - want).abs().max().item() < 1e-10, L


def test_slstm_loop_is_the_unstabilized_recurrence():
    """The stabilizer cancels in c / n: the loop equals the plain recurrence (i = exp(i~),
    f = sigmoid(f~)) in float64; in bf16 it runs and stays finite."""
    torch.manual_seed(0)
    d, nh, B, S = 16, 2, 3, 12
    cell = forms.SLSTMLoop(d, nh).double()
    x = torch.randn(B, S, d, dtype=torch.float64)
    pre = [w(x).view(B, S, nh, d // nh) for w in (cell.wz, cell.wi, cell.wf, cell.wo)]
    h = c = n = torch.zeros(B, nh, d // nh, dtype=torch.float64)
    hs = []
    for t in range(S):
        g = [pre[j][:, t] + torch.einsum("bhe,hef->bhf", h, cell.R[j]) for j in range(4)]
        c = torch.sigmoid(g[2]) * c + torch.exp(g[1]) * torch.tanh(g[0])
        n = torch.sigmoid(g[2]) * n + torch.exp(g[1])
        h = torch.sigmoid(g[3]) * c / n
        hs.append(h)
    want = cell.out(torch.stack(hs, 1).reshape(B, S, d))
    assert torch.allclose(cell(x), want, rtol=1e-10, atol=1e-12)
    row = dict(form="slstm_loop", size=dict(d=32, nh=2, S=8, B=2), dtype="bf16", mode="fwd")
    model, (xb,) = forms.build(row, "cpu")
    y = model(xb)
    assert y.shape == xb.shape and y.dtype == torch.bfloat16 and torch.isfinite(y).all()


def test_list_prints_the_grid_and_quick_covers_every_form(capsys):
    assert run.main(["--list", "--quick", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    quick = [r for r in forms.grid(quick=True)]
    assert f"{len(quick)} rows (cuda, --quick)" in out
    assert {r["form"] for r in quick} == set(forms.FORMS)
    assert {r["mode"] for r in quick} == {"fwd", "train"}
    assert run.main(["--list", "--device", "cuda", "--only", "slstm_loop", "--modes", "train"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[:-1] and all("slstm_loop" in ln and ln.endswith("train") for ln in lines[:-1])
    labels = [forms.label(r) for r in forms.grid()]
    assert len(labels) == len(set(labels))  # every row has its own label (--only picks by it)


def test_bench_dispatches_the_sweep_suite(capsys):
    from torch_xaccel.bench import cli

    assert cli.main(["sweep", "--list", "--cpu"]) == 0
    assert "rows (cpu)" in capsys.readouterr().out


def test_errors_mark_wrong_past_three_times_eager_and_nonfinite_outputs():
    row = dict(dtype="bf16", mode="fwd")
    ref = torch.ones(100)
    eager = ref + 0.01  # eager's error 1e-2: bound 3e-2 + 1e-3
    ok = {"eager": {"out": eager}, "inductor": {"out": eager}, "xaccel": {"out": ref + 0.025},
          "reference": {"out": ref}}
    assert run._errors(row, ok, "highest")["wrong"] == []
    bad = dict(ok, xaccel={"out": ref + 0.05})
    err = run._errors(row, bad, "highest")
    assert err["wrong"] == ["out"] and err["inductor_wrong"] == []
    nan = dict(ok, xaccel={"out": torch.full((100,), float("nan"))})
    assert run._errors(row, nan, "highest")["wrong"] == ["out"]
    fp32 = run._errors(dict(row, dtype="fp32"), dict(ok, xaccel={"out": ref + 0.0305}), "high")
    assert fp32["floor"] == run.FLOOR_FP32["high"] and fp32["wrong"] == []


def test_a_cpu_row_runs_end_to_end_in_its_own_process(tmp_path):
    """One tiny row through `bench sweep`: the row subprocess times all three variants and the
    sweep writes its table, its JSON rows, and the worst ratio as its last line. XACCEL_CHOOSE=0
    here only (the measured choice compiles Inductor candidates too: slow on a CPU)."""
    cmd = [sys.executable, "-m", "torch_xaccel.bench", "sweep", "--cpu", "--only", "gemm_chain M16 d64 bf16 fwd",
           "--out", str(tmp_path), "--env", "XACCEL_CHOOSE=0", "--time-budget", "0.05", "--min-rounds", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("worst xaccel / min(eager, inductor, where right): ")
    rows = [json.loads(ln) for ln in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    r = rows[0]
    assert r["status"] == "ok", r.get("status")
    assert set(r["ms"]) == {"eager", "inductor", "xaccel"} and all(v > 0 for v in r["ms"].values())
    assert r["rounds"] >= 3 and all(len(t) == r["rounds"] for t in r["round_ms"].values())
    assert set(r["first_call_s"]) == {"eager", "inductor", "xaccel"}
    assert r["replaced"].get("gemm_epilogue", 0) >= 1 and isinstance(r["choice"], list)
    assert r["errors"]["xaccel"] is not None and r["reference"] == "float32"
    assert r["ratio"] == r["ms"]["xaccel"] / min(r["ms"]["eager"], r["ms"]["inductor"])
    md = (tmp_path / "sweep.md").read_text()
    assert "| gemm_chain | M16 d64 | bf16 | fwd |" in md and "worst xaccel" in md


def test_a_row_past_its_timeout_is_a_row_with_its_status(tmp_path):
    row = dict(forms.grid(cpu=True)[0], device="cpu", precision="highest", time_budget_s=0.05, min_rounds=3)
    env, _ = run.row_env({})
    res = run.run_subprocess(row, 0.5, env, str(tmp_path / "log"))
    assert res["status"].startswith("timeout after") and "in " in res["status"], res["status"]
    assert res["label"] == forms.label(row) and "log_tail" in res
