"""How fast does xaccel::mlstm run fp32 inputs, at each precision torch's float32 matmul setting
allows, beside bf16? On the GPU:

    python benchmarks/mlstm_fp32.py [--quick] [--shapes B,NH,S,DH;...] [--verbose]

Per shape (B, NH, S, DH; DQK = DV = DH, chunk 64) and mode, `torch.ops.xaccel.mlstm` forward
(under no_grad) and forward + backward (.grad reset before each call) timed with
triton.testing.do_bench (median ms):

- fp32-ieee:   fp32 dots forced to "ieee" (FMA units; codegen/precision.forced), the
               default configs untuned (a comparison, not a mode users get)
- fp32-tf32x3: torch.set_float32_matmul_precision("highest") (the default): 3xTF32 dots
- fp32-tf32:   torch.set_float32_matmul_precision("high"): TF32 dots
- bf16:        the same values in bf16

All modes read the same input values (drawn in bf16, upcast for fp32), so "h vs ieee" (the
relative difference of h from fp32-ieee's) shows each precision's error at that shape. "first
call s": the first forward + backward, compiles and tuning included (cold or warm as the kernel
and tuning caches are: XACCEL_CACHE_DIR, Triton's cache). A fallback to the reference is an error
(the row says why). Prints each row as it is measured, then one markdown table and the
fp32-tf32 / bf16 ratios (the goal: at most 2). --quick: the first shape only and shorter timing;
--verbose: after each shape the tuning decisions with every candidate's time (the kernels' own
time, without autograd), at the end every compiled kernel's registers, spills and shared memory.

The times are the op's as a model calls it, host work included: at (4, 8, 1024, 128) the calls
are host-bound on an H100 (fwd+bwd 1.7-2.0 ms in every mode, while the tuner times the bf16
kernels at ~0.6 ms), so compare precisions at the larger shapes or with --verbose. On an H100
(torch 2.11, Triton 3.6) --quick took 46 s with cold caches; the four shapes take longer cold
(each mode and shape tunes its own configs), much less warm (stored decisions, cached kernels).
"""
import argparse
import contextlib
import os
import sys
import time
import warnings

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, not installed

from torch_xaccel import config, runtime  # noqa: E402
from torch_xaccel.codegen import precision  # noqa: E402
from torch_xaccel.codegen.mlstm import triton_kernels as tm  # noqa: E402
from torch_xaccel.errors import XaccelFallbackWarning  # noqa: E402

SHAPES = [(4, 8, 1024, 128), (2, 8, 4096, 256), (8, 4, 2048, 64), (1, 4, 8192, 512)]
MODES = ["fp32-ieee", "fp32-tf32x3", "fp32-tf32", "bf16"]
CHUNK, EPS = 64, 1e-6


@contextlib.contextmanager
def mode_settings(mode: str):
    """torch's float32 matmul setting (and the private override, XACCEL_TUNE=0) of one mode,
    restored afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if mode == "fp32-tf32" else "highest")
    try:
        with contextlib.ExitStack() as stack:
            if mode == "fp32-ieee":
                stack.enter_context(precision.forced("ieee"))
                stack.enter_context(config.patch(tune=False))
            yield
    finally:
        torch.set_float32_matmul_precision(before)


def inputs(B, NH, S, DH):
    """q, k, v [B, NH, S, DH], i ~ randn, f ~ randn + 3 (forget gates near 0.95), and dh; bf16."""
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return [mk(B, NH, S, DH), mk(B, NH, S, DH), mk(B, NH, S, DH), mk(B, NH, S), mk(B, NH, S) + 3], mk(B, NH, S, DH)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_mode(shape, mode, base, dh_base, quick):
    """(fwd ms, fwd+bwd ms, first call s, h)."""
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    x = [t.to(dtype).requires_grad_() for t in base]
    dh = dh_base.to(dtype)

    def fwd():
        return torch.ops.xaccel.mlstm(*x, None, None, None, EPS, CHUNK)

    def fwd_bwd():
        fwd()[0].backward(dh)

    with mode_settings(mode), warnings.catch_warnings():
        warnings.simplefilter("error", XaccelFallbackWarning)  # a fallback is not the kernel's time
        events = len(runtime.EVENTS)
        B, NH, S, DH = shape
        if not (tm._supported(x[0], x[1], x[2], S, "fwd") and tm._supported(x[0], x[1], x[2], S, "bwd")):
            raise RuntimeError("the kernels do not take this case (the reference would run)")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd_bwd()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        with torch.no_grad():
            h = fwd()[0].detach()
        rep = 30 if quick else 100
        with torch.no_grad():
            fwd_ms = triton.testing.do_bench(fwd, warmup=10, rep=rep, return_mode="median")
        both_ms = triton.testing.do_bench(fwd_bwd, warmup=10, rep=rep, grad_to_none=x, return_mode="median")
        if len(runtime.EVENTS) != events:
            raise RuntimeError(f"fell back to the reference: {runtime.EVENTS[-1]}")
    return fwd_ms, both_ms, first, h


def tuned_configs():
    """The tuning decisions this process made or read while tuning was on: {key: config} (not the
    untimed defaults of fp32-ieee, XACCEL_TUNE=0)."""
    return {k: d.config for k, d in tm._CHOSEN.items() if d.live}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first shape only, shorter timing")
    ap.add_argument("--shapes", default="", help="B,NH,S,DH;... instead of the default shapes")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    ap.add_argument("--verbose", action="store_true", help="also print every tuning decision and the kernels' "
                                                           "registers, spills and shared memory")
    args = ap.parse_args()
    shapes = [tuple(int(n) for n in s.split(",")) for s in args.shapes.split(";") if s] or SHAPES
    if args.quick and not args.shapes:
        shapes = shapes[:1]
    modes = [m for m in MODES if m in args.modes.split(",")]
    import triton
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"float32 matmul precision at start: {torch.get_float32_matmul_precision()}", flush=True)
    t_start = time.perf_counter()
    rows, ratios, shown = [], [], set()
    for shape in shapes:
        try:
            base, dh = inputs(*shape)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the next shape still runs
            print(f"{shape}: inputs FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        results, ref_h = {}, None
        for mode in modes:
            try:
                fwd_ms, both_ms, first, h = run_mode(shape, mode, base, dh, args.quick)
                err = rel(h, ref_h) if ref_h is not None else float("nan")
                if mode == "fp32-ieee":
                    ref_h = h
                results[mode] = (fwd_ms, both_ms)
                line = (f"| {shape} | {mode} | {fwd_ms:.3f} | {both_ms:.3f} | {first:.1f} | "
                        f"{'-' if err != err else f'{err:.1e}'} |")
            except Exception as e:  # noqa: BLE001 - one failing shape or mode must not stop the others
                line = f"| {shape} | {mode} | FAILED {type(e).__name__}: {str(e)[:160]} | | | |"
            finally:
                torch.cuda.empty_cache()
            rows.append(line)
            print(line, flush=True)
        if "fp32-tf32" in results and "bf16" in results:
            t, b = results["fp32-tf32"], results["bf16"]
            ratios.append(f"| {shape} | {t[0] / b[0]:.2f} | {t[1] / b[1]:.2f} |")
        del base, dh, ref_h
        if args.verbose:
            print_decisions(shown)
    print(f"\n(all above in {time.perf_counter() - t_start:.0f} s)\n")
    print("| shape (B, NH, S, DH) | mode | fwd ms | fwd+bwd ms | first call s | h vs ieee |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    if ratios:
        print("\n| shape (B, NH, S, DH) | fwd fp32-tf32 / bf16 | fwd+bwd fp32-tf32 / bf16 |")
        print("|---|---|---|")
        print("\n".join(ratios))
    if args.verbose:
        print("\nkernels (registers / spills / shared memory):")
        for fn in tm._KERNELS.values():
            for caches in getattr(fn, "device_caches", {}).values():
                for k in caches[0].values():
                    if getattr(k, "n_regs", None) is not None:
                        print(f"  {k.name[:44]:44s} warps {k.metadata.num_warps} stages {k.metadata.num_stages} "
                              f"regs {k.n_regs:3d} spills {k.n_spills:5d} B shared {k.metadata.shared:6d} B")


def print_decisions(shown: set) -> None:
    """The tuning decisions made since the last call, each with its candidates' timings."""
    from torch_xaccel.codegen import cache

    for key, cfg in tuned_configs().items():
        if key in shown:
            continue
        shown.add(key)
        entry = cache.read_entry("tuning", key) or {}
        print(f"  tuned {key.split('|tpl')[0]}: {cfg}")
        for c, ms, why in entry.get("timings", []):
            print(f"      {ms if ms is not None else '-':>9} ms  {c}  {why[:120]}")


if __name__ == "__main__":
    main()
