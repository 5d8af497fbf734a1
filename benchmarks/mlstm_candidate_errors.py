"""Relative error of every mLSTM tuning candidate (forward outputs h, C, n, m; backward gradients)
against the fp64 reference / analytic backward, per head shape, dtype and initial state. A
diagnostic for the GPU: it showed the DK-sliced forward kernel wrong at DQK 256/512 on the H200;
it also runs that kernel's experimental configs, which tuning does not offer until they pass here.

    python benchmarks/mlstm_candidate_errors.py
"""
import torch

from torch_xaccel.codegen import triton_mlstm
from torch_xaccel.ops import mlstm
from torch_xaccel.ops.mlstm_backward import backward as analytic

CASES = [(256, 512, 333, torch.bfloat16), (512, 512, 333, torch.bfloat16), (512, 64, 333, torch.bfloat16),
         (512, 128, 150, torch.bfloat16), (512, 128, 150, torch.float16), (128, 128, 333, torch.bfloat16)]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def errors(got, want) -> str:
    return " ".join("-" if w is None else "NaN" if g.isnan().any() else f"{rel_err(g, w):.1e}"
                    for g, w in zip(got, want))


def run(label, fn) -> None:
    try:
        print(label, fn(), flush=True)
    except Exception as e:  # noqa: BLE001 - a config that does not build or fit is a finding
        print(label, "ERROR", type(e).__name__, str(e)[:200], flush=True)


def main() -> None:
    for DK, DV, S, dt in CASES:
        torch.manual_seed(DK)
        B, H = 1, 2
        mk = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
        x = [mk(B, H, S, DK).to(dt), mk(B, H, S, DK).to(dt), mk(B, H, S, DV).to(dt), mk(B, H, S), mk(B, H, S) + 3]
        for with_state in (False, True):
            st = [mk(B, H, DK, DV) * .1, mk(B, H, DK) * .1, mk(B, H)] if with_state else [None] * 3
            d = lambda t: None if t is None else t.double()  # noqa: E731
            want = mlstm.reference(*(d(t) for t in x + st))
            cots = [mk(B, H, S, DV), mk(B, H, DK, DV), mk(B, H, DK), mk(B, H)]
            want_g = analytic(*(c.double() for c in cots), *(d(t) for t in x + st))
            h = want[0].to(dt)  # the backward reads the saved output: give it the reference's
            print(f"== DK{DK} DV{DV} S{S} {dt} state={with_state} (fwd: h C n m; bwd: dq dk dv di df dC0 dn0 dm0)")
            for cfg in triton_mlstm.forward_candidates(DK, DV):
                run(f"  fwd {cfg}", lambda: errors(triton_mlstm._forward(cfg, *x, *st, 1e-6), want))
            for cfg in triton_mlstm.experimental_forward_configs(DK, DV):  # not offered to tuning yet
                run(f"  fwd, experimental {cfg}", lambda: errors(triton_mlstm._forward(cfg, *x, *st, 1e-6), want))
            for cfg in triton_mlstm.backward_candidates(DK, DV):
                run(f"  bwd {cfg}", lambda: errors(triton_mlstm._backward(cfg, cots[0], *cots[1:], *x, *st, 1e-6, h),
                                                   want_g))


if __name__ == "__main__":
    main()
