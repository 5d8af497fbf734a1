"""The benchmark's timing harness: enough timed calls per row, and the spread it reports."""
import torch
import triton.testing

from torch_xaccel.bench import common


def test_bench_times_several_calls_of_a_model_train_step(monkeypatch):
    """do_bench's warmup and rep are milliseconds: a 130 ms train step must get >= 7 timed calls
    and >= 2 warm-up calls, a 27 ms prefill >= 10."""
    seen = {}

    def fake_do_bench(fn, warmup, rep, return_mode, grad_to_none=None):
        seen[len(seen)] = (warmup, rep, return_mode)
        return [3.0, 1.0, 2.5]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    assert common._bench_calls(lambda: None, True) == (2.5, [3.0, 1.0, 2.5])
    assert common._bench(lambda: None, False) == 2.5
    (w_train, rep_train, mode), (w_other, rep_other, _) = seen[0], seen[1]
    assert mode == "all"
    assert int(rep_train / 130) >= 7 and int(w_train / 130) >= 2
    assert int(rep_other / 27) >= 10 and int(w_other / 27) >= 1


def test_bench_reads_every_form_do_bench_returns_its_calls_in(monkeypatch):
    """return_mode="all" gives a list in current Triton and a tensor in some releases."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for form in ([4.0, 2.0, 3.0], torch.tensor([4.0, 2.0, 3.0]), (4.0, 2.0, 3.0)):
        monkeypatch.setattr(triton.testing, "do_bench", lambda fn, form=form, **kw: form)
        assert common._bench_calls(lambda: None, True) == (3.0, [4.0, 2.0, 3.0])


def test_model_profile_gaps_counts_idle_time_between_kernels_and_blames_late_launches(capsys):
    """benchmarks/model_profile.py --gaps on a hand-made trace: overlapping kernels leave no gap,
    a kernel launched after the GPU went idle is the host's, a blocking call is counted."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "model_profile.py")
    spec = importlib.util.spec_from_file_location("model_profile", path)
    mp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mp)

    def kernel(name, ts, dur, corr):
        return dict(cat="kernel", name=name, ts=ts, dur=dur, args=dict(correlation=corr))

    def call(name, ts, dur, corr):
        return dict(cat="cuda_runtime", name=name, ts=ts, dur=dur, args=dict(correlation=corr))
    events = [kernel("a", 0, 200, 1), kernel("b", 50, 50, 2),  # b inside a (another stream): busy until 200
              kernel("c", 220, 10, 3),   # 20 us idle, launched at 5: in time
              kernel("d", 450, 10, 4),   # 220 us idle, launched at 400, 170 us late
              call("cudaLaunchKernel", 0, 2, 1), call("cudaLaunchKernel", 2, 2, 2),
              call("cudaLaunchKernel", 5, 2, 3), call("cudaStreamSynchronize", 10, 170, 9),
              call("cudaLaunchKernel", 400, 2, 4), dict(cat="cpu_op", name="aten::slow", ts=235, dur=160)]
    mp.report_gaps(events, top=5, min_us=10)
    out = capsys.readouterr().out
    assert "GPU span 0.46 ms, idle 0.24 ms in 2 gaps >= 10 us; host-late launches 0.22 ms" in out
    assert "cudaStreamSynchronize: x1, 0.170 ms" in out
    assert "220.0 us idle, launched 170 us after the GPU went idle: c -> d" in out and "aten::slow" in out
    assert "20.0 us idle, launched in time: b -> c" in out


def test_bench_imports_resolve_outside_the_repository_root(tmp_path):
    """`python -m torch_xaccel.bench ...` run from another directory: every import the bench makes
    is the installed package's (a bare `codegen` resolves only with the checkout as the cwd)."""
    import subprocess
    import sys

    script = ("from torch_xaccel import families; from torch_xaccel.bench import cli, common; "
              "[families.resolve(path) for path in cli.suites().values()]; print(repr(common.tuning_report(0.0)))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "XACCEL_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "''"
