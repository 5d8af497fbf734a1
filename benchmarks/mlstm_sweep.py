"""Which tile configuration of the generated mLSTM kernels is fastest on this GPU, and what do the
kernels' A/B forms (codegen/mlstm/settings.py) cost? Times configs on the GPU (bf16), to pick the
defaults in codegen/mlstm/configs.py:

    python benchmarks/mlstm_sweep.py [--quick] [--sliced] [--profile] [--scan-ab] [--bwd-kept] [--route-ab]
                                     [--variants JSON] [--shapes B,H,S,DK,DV;...]

Each line: shape, phase, config, median ms, and the relative error of h (forward) or dq
(backward) against the default config, so a config that breaks the math cannot win.
"""
import argparse
import json

import torch
import triton.testing

from torch_xaccel.codegen.mlstm import configs as mlstm_configs, settings, triton_kernels as tm

SHAPES = [(8, 16, 8192, 128, 128), (8, 8, 4096, 256, 512)]


def _inputs(B, H, S, DK, DV):
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return [mk(B, H, S, DK), mk(B, H, S, DK), mk(B, H, S, DV), mk(B, H, S), 3.0 + mk(B, H, S)]


def _kept_forward(shape):
    """(inputs, h, a random dh, the kept chunk states) of one training forward at chunk 64: what
    a backward from kept states starts from."""
    x = _inputs(*shape)
    h, C, n, m, *kept = tm.forward(None, *x, None, None, None, 1e-6, 64, keep_chunk_states=True)
    return x, h, torch.randn_like(h), [*kept, C, n, m]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep(shape, fwd_cfgs, bwd_cfgs):
    x = _inputs(*shape)
    default_f, default_b = mlstm_configs.forward_config, mlstm_configs.backward_config
    h_ref = tm.forward(None, *x, None, None, None, 1e-6, 64)[0]
    dh = torch.randn_like(h_ref)
    g_ref = tm.backward(None, dh, None, None, None, *x, None, None, None, 1e-6, 64, h_ref) if bwd_cfgs else None
    for cfg in fwd_cfgs:
        mlstm_configs.forward_config = lambda DK, DV, itemsize=2, c=cfg: dict(c)
        try:
            h = tm.forward(None, *x, None, None, None, 1e-6, 64)[0]
            ms = triton.testing.do_bench(lambda: tm.forward(None, *x, None, None, None, 1e-6, 64), warmup=10, rep=50)
            print(f"{shape} fwd {cfg}: {ms:.3f} ms  rel {_rel(h, h_ref):.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a config that does not build is a finding
            print(f"{shape} fwd {cfg}: FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
    mlstm_configs.forward_config = default_f
    for cfg in bwd_cfgs:
        mlstm_configs.backward_config = lambda DK, DV, itemsize=2, c=cfg: dict(c)
        try:
            g = tm.backward(None, dh, None, None, None, *x, None, None, None, 1e-6, 64, h_ref)
            ms = triton.testing.do_bench(
                lambda: tm.backward(None, dh, None, None, None, *x, None, None, None, 1e-6, 64, h_ref),
                warmup=5, rep=30)
            print(f"{shape} bwd {cfg}: {ms:.3f} ms  rel dq {_rel(g[0], g_ref[0]):.1e} df {_rel(g[4], g_ref[4]):.1e}",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{shape} bwd {cfg}: FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
    mlstm_configs.backward_config = default_b


def kernel_times(fn, calls: int = 3):
    """(GPU kernel ms per call, [(ms per call, launches per call, kernel name)] longest first) of fn
    under the torch profiler, after one unprofiled call."""
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted(p.key_averages(), key=lambda e: -e.device_time_total)
    rows = [(e.device_time_total / calls / 1e3, e.count // calls, e.key) for e in events]
    return sum(r[0] for r in rows), rows


def profile(shape):
    """Per-kernel CUDA time of one forward + backward through the op and autograd (glue, casts and
    the .grad accumulation included), at the default configs; then the op's fwd+bwd timed with
    .grad accumulating (as the bench and the anchors' script do) and with .grad reset to None before
    each call (as after optimizer.zero_grad()), beside the xLSTM library's when importable."""
    x = [t.detach().requires_grad_() for t in _inputs(*shape)]

    def op():  # what a training graph runs: the backward reads the forward's chunk states
        return torch.ops.xaccel.mlstm_with_chunk_states(*x, None, None, None, 1e-6, 64)[0]
    runs = {"xaccel": op}
    try:
        from mlstm_kernels.torch import get_mlstm_kernel

        kern = get_mlstm_kernel("chunkwise--triton_limit_chunk")
        runs["library"] = lambda: kern(q=x[0], k=x[1], v=x[2], i=x[3], f=x[4], chunk_size=64)
    except ImportError as e:
        print(f"{shape} library not importable: {e}", flush=True)
    dh = torch.randn_like(op())

    for name, fn in runs.items():
        def fwd_bwd(fn=fn):
            fn().backward(dh)
        total, rows = kernel_times(fwd_bwd)
        print(f"{shape} {name}: GPU kernel time {total:.3f} ms per fwd+bwd (.grad accumulating)", flush=True)
        for ms, n, key in rows[:16]:
            print(f"{shape}   {ms:8.3f} ms x{n:<3d} {key[:90]}", flush=True)
        acc = triton.testing.do_bench(fwd_bwd, warmup=10, rep=50)
        fresh = triton.testing.do_bench(fwd_bwd, warmup=10, rep=50, grad_to_none=x)
        print(f"{shape} {name}: fwd+bwd {acc:.3f} ms with .grad accumulating, {fresh:.3f} ms with .grad reset",
              flush=True)
    kernel_resources()


def kernel_resources():
    """Registers per thread, spilled bytes and shared memory of every generated mLSTM kernel
    compiled so far, as ptxas of the GPU's Triton reports them (occupancy: 64K registers and
    228 KB shared memory per H100/H200 SM); a local compile report does not predict these."""
    for fn in tm._KERNELS.values():
        for caches in getattr(fn, "device_caches", {}).values():
            for k in caches[0].values():
                if getattr(k, "n_regs", None) is not None:
                    print(f"  {k.name[:40]:40s} warps {k.metadata.num_warps} regs {k.n_regs:3d} "
                          f"spills {k.n_spills:5d} B shared {k.metadata.shared:6d} B", flush=True)


def scan_ab(shape, only=()):
    """The two sequential scans with their gate terms recomputed at every step (the switch off)
    and precomputed in parallel (on): the forward (chunk_scan_factors: mlstm_chunk_gates before
    the chunk-state scan) and the backward from kept chunk states, what training runs
    (scan_row_factors: row factors from mlstm_bwd_rows); and that backward with mlstm_bwd_rows
    reading the forward's den and m_t per row or recomputing q k^T (saved_rows), and with its
    tail in torch or in one kernel (fused_route; --route-ab runs only that); per-kernel times,
    launches, median times, and the outputs' difference between the two (bf16: both carry their
    own rounding)."""
    x, h, dh, states = _kept_forward(shape)
    bwd = lambda: tm.backward(None, dh, None, None, None, *x, None, None, None, 1e-6, 64, h, states)  # noqa: E731
    phases = {"chunk_scan_factors": lambda: tm.forward(None, *x, None, None, None, 1e-6, 64, keep_chunk_states=True),
              "scan_row_factors": bwd, "saved_rows": bwd, "fused_route": bwd}
    for flag, run in phases.items():
        if only and flag not in only:
            continue
        outs = {}
        for value in (False, True):
            with settings.override(**{flag: value}):
                outs[value] = run()
                total, rows = kernel_times(run)
                ms = triton.testing.do_bench(run, warmup=10, rep=50)
            print(f"{shape} {flag}={value}: {ms:.3f} ms (kernels {total:.3f}, {sum(r[1] for r in rows)} launches)",
                  flush=True)
            for kms, k, key in rows[:6]:
                print(f"{shape}   {kms:8.3f} ms x{k:<3d} {key[:90]}", flush=True)
        errs = " ".join(f"{_rel(a, b):.1e}" for a, b in zip(outs[True][:5], outs[False][:5]))
        print(f"{shape} {flag} True vs False, first five outputs: {errs}", flush=True)


def backward_kept(shape, cfgs):
    """The backward from the forward's kept chunk states (what a training graph runs) at each
    config: median ms, the kernels' times, and every input gradient's difference from the first
    config's (bf16: a few 1e-3 between right configs)."""
    x, h, dh, states = _kept_forward(shape)
    ref, default_b = None, mlstm_configs.backward_config
    try:
        for cfg in cfgs:
            mlstm_configs.backward_config = lambda DK, DV, itemsize=2, c=cfg: dict(c)
            run = lambda: tm.backward(None, dh, None, None, None, *x, None, None, None, 1e-6, 64, h, states)  # noqa: E731
            try:
                got = run()
                ref = ref or got  # the first config that runs
                total, rows = kernel_times(run)
                ms = triton.testing.do_bench(run, warmup=10, rep=50)
                errs = " ".join(f"{_rel(a, b):.1e}" for a, b in zip(got[:5], ref[:5]))
                print(f"{shape} bwd kept {cfg}: {ms:.3f} ms (kernels {total:.3f})  vs first: {errs}", flush=True)
                for kms, k, key in rows[:7]:
                    print(f"{shape}   {kms:8.3f} ms x{k:<3d} {key[:90]}", flush=True)
            except Exception as e:  # noqa: BLE001 - a config that does not build is a finding
                print(f"{shape} bwd kept {cfg}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
    finally:
        mlstm_configs.backward_config = default_b


def main():
    settings.configure(tune=False)  # fixed configs: this script times them itself
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sliced", action="store_true",
                    help="only the forward: the whole-tile kernel's first config and the sliced kernel's neighbours"
                         " (mlstm_configs.sliced_sweep_configs)")
    ap.add_argument("--profile", action="store_true", help="only the per-kernel profile at the default configs")
    ap.add_argument("--scan-ab", action="store_true", help="only the two scans with and without precomputed gate terms")
    ap.add_argument("--bwd-kept", action="store_true",
                    help="only the backward from kept chunk states, at every backward candidate")
    ap.add_argument("--route-ab", action="store_true", help="only the backward's tail in torch and fused (fused_route)")
    ap.add_argument("--ab", default="", help="with --scan-ab: only these switches (comma-separated, e.g. saved_rows)")
    ap.add_argument("--variants", default="[]",
                    help='with --bwd-kept: also each of these key overrides (a JSON list, e.g. [{"SW": 8}]) applied '
                         "to each of the first --variant-bases candidates")
    ap.add_argument("--variant-bases", type=int, default=1)
    ap.add_argument("--shapes", default="", help="B,H,S,DK,DV;... in place of the two benchmark shapes")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s] or SHAPES
    print("defaults:", {s: (mlstm_configs.forward_config(s[3], s[4]), mlstm_configs.backward_config(s[3], s[4]))
                        for s in shapes})
    for shape in shapes:
        DK, DV = shape[3], shape[4]
        base_f, base_b = mlstm_configs.forward_config(DK, DV), mlstm_configs.backward_config(DK, DV)
        fwd = [base_f, dict(base_f, warps=4), dict(base_f, BV=min(DV, 256)), dict(base_f, BV=64, warps=4),
               dict(base_f, BK=min(DK, 64), BVS=min(DV, 128))]
        bwd = [base_b, dict(base_b, stages=1), dict(base_b, BV=64, stages=1), dict(base_b, L=32, BV=64, stages=1),
               dict(base_b, warps=4)]
        if args.profile:
            profile(shape)
            continue
        if args.bwd_kept:
            cands = mlstm_configs.backward_candidates(DK, DV)
            extra = [mlstm_configs.fit(dict(c, **v), DK, DV) for c in cands[:args.variant_bases]
                     for v in json.loads(args.variants)]
            backward_kept(shape, cands + extra)
            continue
        if args.route_ab:
            scan_ab(shape, ["fused_route"])
            continue
        if args.scan_ab:
            scan_ab(shape, [f for f in args.ab.split(",") if f])
            continue
        if args.quick:
            fwd, bwd = fwd[:4], bwd[:2]
        if args.sliced:
            whole = [c for c in mlstm_configs.forward_candidates(DK, DV) if not c.get("BKQ")][:1]
            sweep(shape, whole + mlstm_configs.sliced_sweep_configs(DK, DV), [])
            profile(shape)
            continue
        profile(shape)
        sweep(shape, fwd, bwd)


if __name__ == "__main__":
    main()
