"""How fast is each tile configuration of the GEMM + epilogue kernels for one shape, and where does a
training step's GPU time go?

A tuning aid (GPU): times every tile configuration of the generated GEMM + epilogue kernel for one
shape against cuBLAS alone and the ATen composition, and profiles a training step's kernels.

    python benchmarks/gemm_probe.py configs M K N      # e.g. 16384 4096 16384, or 128 4096 16384
    python benchmarks/gemm_probe.py train [eager] [xaccel] [xaccel-nobwd] [inductor]
                                                       # top CUDA kernels of a 4-layer MLP train step
    python benchmarks/gemm_probe.py cutlass M K N      # CUTLASS configs (LARGE + EXTRA; SMALL for M <= 256), plain and
                                                       # with the chain, against cuBLAS, in do_bench and back to back
                                                       # (M <= 256: GPU time and a graph replay in do_bench, as the
                                                       # bench times decode, beside the best Triton config and a
                                                       # W-reading floor), two rounds; cuBLAS's kernel name

xaccel-nobwd: xaccel with XACCEL_BACKWARD_FUSION=0 (the backward as aot_autograd traced it), for an
A/B of the backward graph's fused GEMM chains in one process.
"""
import os
import sys

import torch
import triton.testing

from torch_xaccel.codegen import tuning
from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels
from torch_xaccel.ops.gemm_epilogue.epilogue_ir import Epilogue
from torch_xaccel.ops.gemm_epilogue.reference import forward as reference

GELU_RES = Epilogue(({"op": "acc", "index": 0}, {"op": "load", "operand": 0, "bcast": "row"},
                     {"op": "add", "in": [0, 1]}, {"op": "gelu_tanh", "in": [2]},
                     {"op": "load", "operand": 1, "bcast": "full"}, {"op": "add", "in": [3, 4]}), (5,)).to_json()


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def configs(M, K, N):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    ops = [torch.randn(N, device="cuda", dtype=torch.bfloat16), torch.randn(M, N, device="cuda", dtype=torch.bfloat16)]
    flop = 2 * M * N * K
    timer = tuning.gpu_ms if M <= gemm_kernels.SMALL_M_ROWS else bench  # decode sizes: GPU time, as tuning does
    print(f"M{M} K{K} N{N} ({'GPU time' if timer is not bench else 'do_bench'}): "
          f"cuBLAS alone {timer(lambda: x @ w.t()):.4f} ms, "
          f"ATen composition {timer(lambda: reference(x, [w], ops, GELU_RES, True)):.4f} ms", flush=True)
    case = gemm_kernels._Case(x, [w], ops, GELU_RES, True)
    outs = case.new_outputs()
    cands = gemm_kernels.LARGE + gemm_kernels.SMALL_M if M > 256 else gemm_kernels.SMALL_M + gemm_kernels.LARGE[:4]
    for cfg in cands:
        if not case.usable(cfg):
            continue
        try:
            ms = timer(lambda: case.launch(cfg, outs))
            print(f"  {cfg}: {ms:.4f} ms  {flop / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  {cfg}: FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)


PLAIN = Epilogue(({"op": "acc", "index": 0},), (0,)).to_json()
# tile shapes tried only here; a winner moves to cutlass_kernels.LARGE
EXTRA = [("cutlass", 256, 128, 64, 2, 1, 8, 0), ("cutlass_pp", 128, 128, 64, 1, 1, 8, 0),
         ("cutlass_pp", 64, 256, 64, 2, 1, 8, 0), ("cutlass_pp", 128, 128, 64, 2, 1, 4, 2),
         ("cutlass_pp", 128, 128, 64, 2, 1, 8, 2)]


def cutlass_configs(M):
    """What tuning times at M (M > 64), and EXTRA above the decode-sized rows."""
    return gemm_kernels.cutlass_configs(M) + (EXTRA if M > gemm_kernels.SMALL_M_ROWS else [])


def cutlass_sources(M, K, N):
    """(name, source) of every kernel `cutlass` times: build them ahead with cutlass_kernels.build_all."""
    from torch_xaccel.codegen.gemm_epilogue import cutlass_kernels

    out = []
    for text in (PLAIN, GELU_RES):
        ep = Epilogue.from_json(text)
        bcast = ep.broadcasts()
        out += [cutlass_kernels.render(ep, torch.bfloat16, [torch.bfloat16] * len(bcast), bcast, True, c)
                for c in cutlass_configs(M)]
    return out


def cutlass(M, K, N):
    from torch.profiler import ProfilerActivity, profile

    from torch_xaccel.codegen.gemm_epilogue import cutlass_kernels

    cutlass_kernels.build_all(cutlass_sources(M, K, N), "probe")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    ops = [torch.randn(N, device="cuda", dtype=torch.bfloat16), torch.randn(M, N, device="cuda", dtype=torch.bfloat16)]
    flop = 2 * M * N * K
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        x @ w.t()
        torch.cuda.synchronize()
    print("cuBLAS kernel:", [e.key for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0][:3])
    small = M <= gemm_kernels.SMALL_M_ROWS
    runs = {"cuBLAS alone": lambda: x @ w.t()}
    if small:  # one row of x: cuBLAS reads W once and does next to nothing else
        x1 = x[:1].contiguous()
        runs["floor: cuBLAS M1 (reads W once)"] = lambda: x1 @ w.t()
        runs["ATen composition"] = lambda: reference(x, [w], ops, GELU_RES, True)
    for text, label in ((PLAIN, "plain"), (GELU_RES, "chain")):
        case = gemm_kernels._Case(x, [w], ops if text == GELU_RES else [], text, True)
        outs = case.new_outputs()
        for cfg in cutlass_configs(M) + ([("ptr", 64, 128, 64, 8, 4, 4, 0)] if small and text == GELU_RES else []):
            runs[f"{label} {cfg}"] = lambda case=case, cfg=cfg, outs=outs: case.launch(cfg, outs)
    if small:
        from torch_xaccel.bench.common import _graphed
    for rnd in range(2):
        for name, fn in runs.items():
            try:
                if small:  # as the bench times decode: a CUDA-graph replay in do_bench (L2 flushed), and GPU time
                    a, b = bench(_graphed(fn)), tuning.gpu_ms(fn)
                    print(f"  [{rnd}] {name:52s} graph replay {a:.4f} ms  GPU time {b:.4f} "
                          f"({K * N * 2 / b / 1e6:.0f} GB/s of W)", flush=True)
                    continue
                a, b = bench(fn), tuning.gpu_ms(fn)
                print(f"  [{rnd}] {name:52s} do_bench {a:.4f} ms ({flop / a / 1e9:.0f} TFLOP/s)  "
                      f"back to back {b:.4f}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  [{rnd}] {name}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)


def train():
    import time

    from torch.profiler import ProfilerActivity, profile

    from torch_xaccel.bench.common import tuning_report
    from torch_xaccel.bench.gemm_epilogue import mlp_train

    t0 = time.time()
    case = mlp_train(16384)
    f, args, _, step = case.make()
    which = sys.argv[2:] or ["eager", "xaccel"]
    times: dict = {}
    for name in which:  # a name listed again is timed again (interleaved A/B), profiled once
        os.environ["XACCEL_BACKWARD_FUSION"] = "0" if name == "xaccel-nobwd" else "1"
        torch._dynamo.reset()
        fn = f if name == "eager" else torch.compile(f, backend=name.split("-")[0])
        run = step(fn)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        times.setdefault(name, []).append(bench(run))
        print(f"{name}: {times[name][-1]:.3f} ms per step")
        if len(times[name]) > 1:
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    for name, ts in times.items():
        print(f"{name}: median {sorted(ts)[len(ts) // 2]:.3f} ms per step over {len(ts)}: "
              f"{', '.join(f'{t:.3f}' for t in ts)}")
    print(tuning_report(t0))


if __name__ == "__main__":
    if sys.argv[1] == "configs":
        configs(*map(int, sys.argv[2:5]))
    elif sys.argv[1] == "cutlass":
        cutlass(*map(int, sys.argv[2:5]))
    else:
        train()
