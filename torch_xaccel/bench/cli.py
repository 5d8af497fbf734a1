"""The bench's command line: `python -m torch_xaccel.bench <suite>` (usage: the package's docstring).

Its suites: every family whose families.py entry names its `bench` cases, under the family's name,
and the suites of no one family (NON_FAMILY_SUITES); `sweep` hands over to torch_xaccel/sweep.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

from torch_xaccel import families
from torch_xaccel.bench import common
from torch_xaccel.bench.common import _empty_cache, markdown, plot, run_case, tuning_report

# suite -> "module:function" cases(quick) -> list[Case], for the suites that measure no one family
NON_FAMILY_SUITES = {"model": "torch_xaccel.bench.model:cases"}


def suites() -> dict[str, str]:
    """suite name -> "module:function" of its cases: the families' (families.py), then the others."""
    return {**{f.name: f.bench for f in families.FAMILIES if f.bench}, **NON_FAMILY_SUITES}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sweep"]:  # its own options: torch_xaccel/sweep/run.py
        from torch_xaccel.sweep import run as sweep

        return sweep.main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m torch_xaccel.bench",
                                description="torch_xaccel side-by-side benchmarks (and `sweep`: see sweep --help)")
    p.add_argument("suite", choices=sorted(suites()))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--quick", action="store_true", help="smaller shapes")
    p.add_argument("--no-max-autotune", action="store_true")
    p.add_argument("--only", default="", help="run only the cases whose name contains this text")
    p.add_argument("--paths", default="",
                   help="model suite: only the rows whose label "
                   "('<configuration>, <prefill|train step|decode B1|decode B8>') "
                   "this regular expression finds")
    args = p.parse_args(argv)
    try:
        re.compile(args.paths)
    except re.error as e:
        p.error(f"--paths {args.paths!r} is not a regular expression: {e}")
    common.PATHS = args.paths
    # these suites measure the replacements themselves (sweep measures the default, the measured choice)
    os.environ.setdefault("XACCEL_CHOOSE", "0")
    cases = families.resolve(suites()[args.suite])
    # the suite's own settings (gemm_epilogue's XACCEL_CUTLASS=wait), unless the caller set them
    for name, value in getattr(sys.modules[cases.__module__], "ENV", {}).items():
        os.environ.setdefault(name, value)
    smoke = not torch.cuda.is_available()
    if smoke and not (args.suite == "model" and args.quick):
        print("benchmarks need a CUDA GPU (without one, only `model --quick` runs, as a smoke test of the code path)")
        return 2
    import triton

    import torch_xaccel  # noqa: F401

    torch._dynamo.config.cache_size_limit = 64
    gpu = "CPU smoke run, timings meaningless" if smoke else torch.cuda.get_device_name()
    # the device machine gets a copy of the tree without .git: pass XACCEL_COMMIT from the checkout
    commit = (os.environ.get("XACCEL_COMMIT") or os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip()
              or "unknown")
    header = (f"{args.suite}: {time.strftime('%Y-%m-%d')}, {gpu}, torch {torch.__version__}, "
              f"triton {triton.__version__}, commit {commit}; bf16, median of triton.testing.do_bench; "
              f"XACCEL_CUTLASS={os.environ.get('XACCEL_CUTLASS', '1')}, XACCEL_CHOOSE={os.environ['XACCEL_CHOOSE']}")
    print(header)
    started = time.time()
    rows = []
    for case in cases(args.quick):
        if args.only not in case.name:
            continue
        rows += case.runner(case) if case.runner else run_case(case, not args.no_max_autotune)
        _empty_cache()
    if not rows:
        names = [c.name for c in cases(args.quick)]
        print(f"no {args.suite} case matches --only {args.only!r}; the cases are:\n  " + "\n  ".join(names))
        return 2
    md = markdown(rows, header)
    print("\n" + md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"bench_{args.suite}.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(args.out, f"bench_{args.suite}.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    plot(rows, os.path.join(args.out, f"bench_{args.suite}.png"))
    tuned = tuning_report(started)
    if tuned:
        print("\n" + tuned)
        with open(os.path.join(args.out, f"tuning_{args.suite}.md"), "w") as fh:
            fh.write(tuned)
    return 0
