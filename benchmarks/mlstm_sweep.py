"""Which tile configuration of the generated mLSTM kernels is fastest on this GPU? Times configs on
the GPU (bf16), to pick the defaults in codegen/mlstm/configs.py:

    python benchmarks/mlstm_sweep.py [--quick] [--sliced] [--profile] [--bwd-kept] [--variants JSON]
                                     [--shapes B,H,S,DK,DV;...]

Each line: shape, phase, config, median ms, and the relative error of h (forward) or dq
(backward) against the default config, so a config that breaks the math cannot win. The configs
are timed as given (the kernels' own tuning off: XACCEL_TUNE=0, over this script's own cache
directory unless XACCEL_CACHE_DIR is set, so the op's calls run the default configs).
"""
import argparse
import json
import os
import tempfile

import torch
import triton.testing

from torch_xaccel.codegen.mlstm import configs as mlstm_configs, triton_kernels as tm

SHAPES = [(8, 16, 8192, 128, 128), (8, 8, 4096, 256, 512)]


def _inputs(B, H, S, DK, DV):
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return [mk(B, H, S, DK), mk(B, H, S, DK), mk(B, H, S, DV), mk(B, H, S), 3.0 + mk(B, H, S)]


def _kept_forward(shape):
    """(inputs, h, a random dh, the kept chunk states) of one training forward at chunk 64: what
    a backward from kept states starts from."""
    x = _inputs(*shape)
    h, C, n, m, *kept = tm.forward(None, *x, None, None, None, 1e-6, 64, save=True)
    return x, h, torch.randn_like(h), [*kept, C, n, m]


def _forward(cfg, x):
    """The forward kernels at one config (what tm.forward runs once its config is picked)."""
    return tm._forward(cfg, *x, None, None, None, 1e-6)


def _backward(cfg, x, h, dh, kept=()):
    """The backward kernels at one config, reading the forward's kept chunk states where given
    (and walking their chunk), with no gradient of the final state."""
    gm = torch.zeros(h.shape[:2], device=h.device)
    return tm._backward(cfg, dh, None, None, gm, *x, None, None, None, 1e-6, h, tm._kept_states(kept, x[0], x[2], 64))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep(shape, fwd_cfgs, bwd_cfgs):
    x = _inputs(*shape)
    DK, DV = shape[3], shape[4]
    h_ref = _forward(mlstm_configs.forward_config(DK, DV), x)[0]
    dh = torch.randn_like(h_ref)
    g_ref = _backward(mlstm_configs.backward_config(DK, DV), x, h_ref, dh) if bwd_cfgs else None
    for cfg in fwd_cfgs:
        try:
            h = _forward(cfg, x)[0]
            ms = triton.testing.do_bench(lambda: _forward(cfg, x), warmup=10, rep=50)  # noqa: B023
            print(f"{shape} fwd {cfg}: {ms:.3f} ms  rel {_rel(h, h_ref):.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a config that does not build is a finding
            print(f"{shape} fwd {cfg}: FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
    for cfg in bwd_cfgs:
        try:
            g = _backward(cfg, x, h_ref, dh)
            ms = triton.testing.do_bench(lambda: _backward(cfg, x, h_ref, dh), warmup=5, rep=30)  # noqa: B023
            print(f"{shape} bwd {cfg}: {ms:.3f} ms  rel dq {_rel(g[0], g_ref[0]):.1e} df {_rel(g[4], g_ref[4]):.1e}",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{shape} bwd {cfg}: FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)


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
    the .grad accumulation included), at the default configs (XACCEL_TUNE=0, main); then the op's fwd+bwd timed with
    .grad accumulating (as the bench and the anchors' script do) and with .grad reset to None before
    each call (as after optimizer.zero_grad()), beside the xLSTM library's when importable."""
    x = [t.detach().requires_grad_() for t in _inputs(*shape)]

    def op():  # what a training graph runs: the backward reads the forward's chunk states
        return torch.ops.xaccel.mlstm_saving(*x, None, None, None, 1e-6, 64)[0]
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


def backward_kept(shape, cfgs):
    """The backward from the forward's kept chunk states (what a training graph runs) at each
    config: median ms, the kernels' times, and every input gradient's difference from the first
    config's (bf16: a few 1e-3 between right configs)."""
    x, h, dh, states = _kept_forward(shape)
    ref = None
    for cfg in cfgs:
        run = lambda: _backward(cfg, x, h, dh, states)  # noqa: E731, B023
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


def main():
    os.environ["XACCEL_TUNE"] = "0"  # fixed configs: this script times them itself
    os.environ.setdefault("XACCEL_CACHE_DIR", os.path.join(tempfile.gettempdir(), "xaccel-mlstm-sweep"))
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sliced", action="store_true",
                    help="only the forward: the whole-tile kernel's first config and the sliced kernel's neighbours"
                         " (mlstm_configs.sliced_sweep_configs)")
    ap.add_argument("--profile", action="store_true", help="only the per-kernel profile at the default configs")
    ap.add_argument("--bwd-kept", action="store_true",
                    help="only the backward from kept chunk states, at every backward candidate")
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
