"""Is every mLSTM tuning candidate right on this GPU?

Relative error of every mLSTM tuning candidate (forward outputs h, C, n, m; backward gradients)
against the fp64 reference / analytic backward, per head shape, dtype and initial state. A
diagnostic for the GPU, where Triton can miscompile a kernel the interpreter runs right (see
configs.SLICED); it also runs the sliced configs that mlstm_sweep.py --sliced times.
Bounds as in the GPU tests (1e-2 forward, 5e-2 gradients; dm0 printed, not judged); exit status
1 if any config fails or does not run.

    python benchmarks/mlstm_candidate_errors.py
"""
import torch

from torch_xaccel.codegen.mlstm import configs as mlstm_configs, triton_kernels as mlstm_triton
from torch_xaccel.ops import mlstm
from torch_xaccel.ops.mlstm.reference_backward import backward as analytic

CASES = [(256, 512, 333, torch.bfloat16), (512, 512, 333, torch.bfloat16), (512, 64, 333, torch.bfloat16),
         (512, 128, 150, torch.bfloat16), (512, 128, 150, torch.float16), (128, 128, 333, torch.bfloat16),
         (256, 512, 150, torch.float32), (512, 512, 150, torch.float32)]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


FAILED = []


def errors(got, want, tol) -> tuple[str, bool]:
    """The errors as text, and whether all judged ones are within tol. dm0 (the 8th gradient) is
    printed, not judged: it is a sum that cancels to 1e-2..1e-4 of its terms, see
    tests/mlstm/test_gpu_kernels.py::_assert_grads_close for the check that fits it."""
    errs = [None if w is None else float("nan") if g.isnan().any() else rel_err(g, w) for g, w in zip(got, want)]
    ok = all(e is None or j == 7 or e <= tol for j, e in enumerate(errs))  # NaN fails the comparison
    return " ".join("-" if e is None else f"{e:.1e}" for e in errs), ok


def run(label, fn, tol) -> None:
    try:
        text, ok = errors(*fn(), tol)
        print(label, text, "PASS" if ok else "FAIL", flush=True)
    except Exception as e:  # noqa: BLE001 - a config that does not build or fit is a finding
        text, ok = f"ERROR {type(e).__name__}: {str(e)[:200]}", False
        print(label, text, flush=True)
    if not ok:
        FAILED.append(label)


def main() -> None:
    for DK, DV, S, dt in CASES:
        torch.manual_seed(DK)
        B, H = 1, 2
        mk = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
        x = [mk(B, H, S, DK).to(dt), mk(B, H, S, DK).to(dt), mk(B, H, S, DV).to(dt), mk(B, H, S), mk(B, H, S) + 3]
        for with_state in (False, True):
            st = [mk(B, H, DK, DV) * .1, mk(B, H, DK) * .1, mk(B, H)] if with_state else [None] * 3
            d = lambda t: None if t is None else t.double()  # noqa: E731
            want = mlstm.reference.forward(*(d(t) for t in x + st))
            cots = [mk(B, H, S, DV), mk(B, H, DK, DV), mk(B, H, DK), mk(B, H)]
            want_g = analytic(*(c.double() for c in cots), *(d(t) for t in x + st))
            h = want[0].to(dt)  # the backward reads the saved output: give it the reference's
            print(f"== DK{DK} DV{DV} S{S} {dt} state={with_state} (fwd: h C n m; bwd: dq dk dv di df dC0 dn0 dm0)")
            size = dt.itemsize
            for cfg in mlstm_configs.forward_candidates(DK, DV, size):
                run(f"  fwd {cfg}", lambda: (mlstm_triton._forward(cfg, *x, *st, 1e-6), want), 1e-2)
            for cfg in mlstm_configs.sliced_sweep_configs(DK, DV):  # what mlstm_sweep.py --sliced times
                run(f"  fwd, sliced sweep {cfg}", lambda: (mlstm_triton._forward(cfg, *x, *st, 1e-6), want), 1e-2)
            for cfg in mlstm_configs.backward_candidates(DK, DV, size):
                run(f"  bwd {cfg}", lambda: (mlstm_triton._backward(cfg, cots[0], *cots[1:], *x, *st, 1e-6, h), want_g),
                    5e-2)
    print(f"{len(FAILED)} config(s) failed" + "".join(f"\n{label}" for label in FAILED))
    raise SystemExit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
