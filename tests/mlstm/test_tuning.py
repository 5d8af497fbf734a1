"""The mLSTM kernels' tuning: a candidate counts only once it agrees with the reference config,
and the reference is an original kernel, never a newer variant (codegen/mlstm/triton_kernels._fastest)."""
import pytest
import torch
import triton.testing

from torch_xaccel.codegen.mlstm import triton_kernels as mlstm_triton


def _time_of(fn, times):
    """do_bench stand-in: the bench lambda closes over the config being timed."""
    cfg = next(c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, dict))
    return times[cfg["n"]]



def test_mlstm_tuning_survives_a_default_config_that_does_not_fit(monkeypatch):
    """The default config may not build or fit on another Triton/GPU: the first config that runs
    becomes the reference, one that disagrees with it is skipped, the fastest agreeing one wins;
    when none runs, an error names the phase (the runtime then falls back and reports it)."""
    out = torch.randn(64)
    results = {"A": None, "B": out, "C": out * 1.5, "D": out + 1e-4}
    times = {"B": 2.0, "C": 0.5, "D": 1.0}

    def launch(cfg):
        if results[cfg["n"]] is None:
            raise RuntimeError("out of resource: shared memory")
        return (results[cfg["n"]],)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: _time_of(fn, times))
    cands = [{"n": n} for n in "ABCD"]
    timings = []
    assert mlstm_triton._fastest("mlstm fwd", cands[0], cands, launch, timings) == {"n": "D"}
    assert [t[1] for t in timings] == [None, 2.0, None, 1.0]
    assert "differs" in timings[2][2] and "shared memory" in timings[0][2]
    with pytest.raises(RuntimeError, match="no candidate config of mlstm fwd runs"):
        mlstm_triton._fastest("mlstm fwd", cands[0], cands[:1], launch, [])


def test_mlstm_tuning_reference_is_an_original_kernel(monkeypatch):
    """A newer kernel variant listed first (the split backward, SPLIT3, is the default) is checked
    against the first original config, not taken as the reference: a variant that disagrees
    loses even when it is the fastest."""
    out, dv = torch.randn(64), torch.randn(32)
    # gradients (dq, dk, dv, di, df, dC0): "split" is wrong in dq; "dvbad" only in dv, the output of
    # another kernel of the split backward; "dm0" differs only in an initial-state gradient, which
    # cancels badly in bf16 and is not compared
    results = {"split": (out * 2, out, dv), "dvbad": (out, out, dv * 2), "sliced": (out + 1e-4, out, dv),
               "dm0": (out, out, dv, None, None, dv * 3), "orig": (out, out, dv)}
    times = {"split": 0.1, "dvbad": 0.2, "dm0": 0.3, "sliced": 0.5, "orig": 1.0}
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: _time_of(fn, times))
    cands = [{"n": "split", "DVS": 64, "DKS": 128}, {"n": "dvbad", "DVS": 64}, {"n": "sliced", "BKQ": 64},
             {"n": "orig"}]
    timings = []
    got = mlstm_triton._fastest("mlstm bwd", cands[0], cands, lambda cfg: results[cfg["n"]], timings)
    assert got == {"n": "sliced", "BKQ": 64}
    errors = dict((t[0]["n"], t[2]) for t in timings)
    assert "differs" in errors["split"] and "differs" in errors["dvbad"]
    cands.insert(3, {"n": "dm0"})
    assert mlstm_triton._fastest("mlstm bwd", cands[0], cands, lambda cfg: results[cfg["n"]], []) == {"n": "dm0"}
