"""The benchmark's timing harness: enough timed calls per row, and the spread it reports."""
import torch
import triton.testing

from torch_xaccel import bench


def test_bench_times_several_calls_of_a_model_train_step(monkeypatch):
    """do_bench's warmup and rep are milliseconds: a 130 ms train step must get >= 7 timed calls
    and >= 2 warm-up calls, a 27 ms prefill >= 10 (the earlier 50 ms timed a train step once)."""
    seen = {}

    def fake_do_bench(fn, warmup, rep, return_mode, grad_to_none=None):
        seen[len(seen)] = (warmup, rep, return_mode)
        return [3.0, 1.0, 2.5]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    assert bench._bench_calls(lambda: None, True) == (2.5, [3.0, 1.0, 2.5])
    assert bench._bench(lambda: None, False) == 2.5
    (w_train, rep_train, mode), (w_other, rep_other, _) = seen[0], seen[1]
    assert mode == "all"
    assert int(rep_train / 130) >= 7 and int(w_train / 130) >= 2
    assert int(rep_other / 27) >= 10 and int(w_other / 27) >= 1


def test_bench_reads_every_form_do_bench_returns_its_calls_in(monkeypatch):
    """return_mode="all" gives a list in current Triton and a tensor in some releases."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for form in ([4.0, 2.0, 3.0], torch.tensor([4.0, 2.0, 3.0]), (4.0, 2.0, 3.0)):
        monkeypatch.setattr(triton.testing, "do_bench", lambda fn, form=form, **kw: form)
        assert bench._bench_calls(lambda: None, True) == (3.0, [4.0, 2.0, 3.0])
