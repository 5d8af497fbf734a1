"""Where a compiled sweep row's host time goes: the row's model under xaccel with every replacement
kept beside the eager rest (XACCEL_CHOOSE=0), plain calls after warm-up under cProfile, the
functions with the most time of their own. Run on the GPU machine:

    python benchmarks/host_profile.py --only "mlstm_paper d1024 NH4 (DH256) S2048 B8 bf16 fwd" [--calls 20]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from torch_xaccel.sweep import forms
from torch_xaccel.sweep.run import _make_call


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", required=True)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--top", type=int, default=45)
    args = p.parse_args()
    import torch_xaccel  # noqa: F401

    row = next(r for r in forms.grid() if args.only in forms.label(r))
    model, inputs = forms.build({**row, "device": "cuda"}, "cuda")
    fn = torch.compile(model, backend="xaccel", options={"xaccel.choose": False, "xaccel.fallback": "eager"})
    call = _make_call(row, model, fn, inputs)
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumtime").print_stats(r"torch_xaccel|codegen|triton", args.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
