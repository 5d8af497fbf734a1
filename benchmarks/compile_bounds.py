"""First-call time of forms nobody here wrote the kernels for, with backend="xaccel" beside
Inductor's default compile of the same code, in one process: the mLSTM spellings (found by the
structural walk at any length, or by the numeric proof at its largest size), an sLSTM-shaped loop
over 4T + 1 per-step inputs that is no sLSTM (which the mLSTM proof once enumerated for minutes),
with every pass on. Each row: seconds of the first call (trace, compile, one run) for xaccel and
for Inductor with its caches off (a cold compile), and what xaccel's report says. Compile time,
not speed: run on a CPU

    python benchmarks/compile_bounds.py [--only NAME]

or on the GPU machine (the inputs go to CUDA when there is one).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.mlstm import spellings  # noqa: E402
from tests.mlstm.test_provenance import slstm_like_loop  # noqa: E402


def _slstm_like_inputs(device, T=24):
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(2, 2, 8, generator=g) for _ in range(4 * T)] + [torch.randn(2, 8, 8, generator=g) * 0.3]
    return [t.to(device) for t in x]


def _cases(device):
    mlstm = lambda fn, **kw: (fn, [t.to(device) for t in spellings.inputs(grad=False, **kw)])  # noqa: E731
    return {
        "paper S1024": mlstm(spellings.paper, B=1, H=2, S=1024, D=16),
        "paper S4096": mlstm(spellings.paper, B=1, H=1, S=4096, D=16),
        "xlstm_cumsum S4096": mlstm(spellings.xlstm_cumsum, B=1, H=1, S=4096, D=16),
        "einsum_scale_last S2048": mlstm(spellings.einsum_scale_last, B=1, H=2, S=2048, D=16),
        "reciprocal (proof) S1024": mlstm(spellings.reciprocal_normalizer, B=1, H=2, S=1024, D=16),
        "reciprocal (proof) S2048": mlstm(spellings.reciprocal_normalizer, B=1, H=4, S=2048, D=16),
        "sLSTM-shaped loop T24": (slstm_like_loop, _slstm_like_inputs(device)),
    }


def first_call(fn, args, backend: str) -> float:
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend)
    start = time.perf_counter()
    with torch.no_grad():
        compiled(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _summary(report) -> str:
    counts = {k: v for k, v in report.counts().items() if v}
    refused = [fb.reason for fb in report.fallbacks if fb.family in ("mlstm", "slstm")]
    return f"{counts or 'nothing replaced'}" + (f"; refused: {refused[0][:90]}" if refused else "")


def main():
    import torch_xaccel

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="rows whose name contains this")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch._inductor.config.force_disable_caches = True  # a cold compile each time, as a user's first
    print(f"torch {torch.__version__}, {device}")
    print(f"{'form':28s} {'xaccel s':>9s} {'inductor s':>11s}  xaccel report")
    for name, (fn, inputs) in _cases(device).items():
        if args.only and args.only not in name:
            continue
        xaccel = first_call(fn, inputs, "xaccel")
        report = torch_xaccel.last_report()
        inductor = first_call(fn, inputs, "inductor")
        print(f"{name:28s} {xaccel:9.1f} {inductor:11.1f}  {_summary(report)}", flush=True)


if __name__ == "__main__":
    main()
