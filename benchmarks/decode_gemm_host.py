"""At decode size (M = 1), which GEMM-chain path costs the least GPU + host time per call?

Host and GPU time of one decode-size GEMM chain (M = 1, bf16) on each path: cuBLAS with the
chain node by node (ops/gemm_epilogue/reference.aten_composition, what a case tuning gave to ATen
runs) and each Triton config through a kept launch plan (codegen/gemm_epilogue/triton_kernels._Plan,
launched directly from its second call). Shapes: the 7B-width xLSTMLarge's decode chains. Host
time: microseconds the CPU spends per call with the GPU kept busy ahead of it (a queued sleep), so
no launch waits; GPU time: tuning.gpu_ms. Plain decode is host-bound, so a path that wins on the
GPU can still lose the token. Run on the GPU machine:

    python benchmarks/decode_gemm_host.py [--listed N] [--configs extra]
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def _ep(nodes, outputs):
    return json.dumps({"nodes": nodes, "outputs": outputs, "v": 1}, sort_keys=True, separators=(",", ":"))


ACC = {"index": 0, "op": "acc"}
CHAINS = {  # name -> (K, N, epilogue, operand kinds, GEMMs)
    "q/k (plain)": (4096, 2048, _ep([ACC], [0]), [], 1),
    "o-gate sigmoid * h": (4096, 4096, _ep([ACC, {"in": [0], "op": "sigmoid"},
                                            {"bcast": "full", "op": "load", "operand": 0},
                                            {"in": [1, 2], "op": "mul"}], [3]), ["full"], 1),
    "out + residual": (4096, 4096, _ep([ACC, {"bcast": "full", "op": "load", "operand": 0},
                                        {"in": [1, 0], "op": "add"}], [2]),
                       ["full"], 1),
    "gate softcap + bias (N8)": (4096, 8, _ep([ACC, {"bcast": "row", "op": "load", "operand": 0},
                                               {"in": [0, 1], "op": "add"},
                                               {"op": "const", "value": 15.0}, {"in": [2, 3], "op": "div"},
                                               {"in": [4], "op": "tanh"},
                                               {"op": "const", "value": 15.0}, {"in": [5, 6], "op": "mul"}], [7]),
                                 ["row"], 1),
    "SwiGLU dual": (4096, 10944, _ep([ACC, {"in": [0], "op": "silu"}, {"index": 1, "op": "acc"},
                                      {"in": [1, 2], "op": "mul"}], [3]),
                    [], 2),
    "down + residual": (10944, 4096, _ep([ACC, {"bcast": "full", "op": "load", "operand": 0},
                                          {"in": [1, 0], "op": "add"}], [2]),
                        ["full"], 1),
    "LM head softcap": (4096, 50304, _ep([ACC, {"op": "const", "value": 30.0}, {"in": [0, 1], "op": "div"},
                                          {"in": [2], "op": "tanh"},
                                          {"op": "const", "value": 30.0}, {"in": [3, 4], "op": "mul"}], [5]), [], 1),
}


def host_us(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # a long GPU sleep queued first: the launches below never wait
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    return us


def main() -> None:
    from torch_xaccel.codegen import tuning
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as tg
    from torch_xaccel.ops.gemm_epilogue.reference import aten_composition

    ap = argparse.ArgumentParser()
    ap.add_argument("--listed", type=int, default=None, help="time only the first N configs tuning lists")
    ap.add_argument("--configs", default="", help="extra configs, as a JSON list of 8-tuples")
    args = ap.parse_args()
    extra = [tuple(c) for c in json.loads(args.configs)] if args.configs else []
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    for name, (K, N, ep, kinds, n_b) in CHAINS.items():
        a = torch.randn(1, K, device=dev, dtype=dt)
        bs = [torch.randn(N, K, device=dev, dtype=dt) / K ** 0.5 for _ in range(n_b)]
        ops = [torch.randn(1, N, device=dev, dtype=dt) if k == "full" else torch.randn(N, device=dev, dtype=dt)
               for k in kinds]
        want = aten_composition(a, bs, ops, ep, True)[0].float()
        aten = lambda: aten_composition(a, bs, ops, ep, True)  # noqa: E731
        rows = [("aten (cuBLAS + chain)", host_us(aten), tuning.gpu_ms(aten) * 1e3, 0.0)]
        case = tg._Case(a, bs, ops, ep, True)
        cands = tg.candidates(case.M, n_b, dt, N)[:args.listed] + extra
        for cfg in cands:
            if not case.usable(cfg) or tg.shared_bytes(cfg, n_b) > tg.SHARED_LIMIT:
                continue
            try:
                plan = tg._Plan(case, cfg, kept=True)
                run = lambda: plan(a, bs, ops)  # noqa: E731
                err = (run()[0].float() - want).abs().max().item() / want.abs().max().item()
                rows.append((f"triton {cfg}", host_us(run), tuning.gpu_ms(run) * 1e3, err))
            except Exception as e:  # noqa: BLE001 - a config this Triton cannot build: say so, go on
                print(f"  {name}: {cfg} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        print(f"\n{name}: M1 K{K} N{N}, {n_b} GEMM(s)", flush=True)
        for label, host, gpu, err in rows:
            print(f"  {label:55s} host {host:6.1f} us  GPU {gpu:6.1f} us  max rel err {err:.1e}", flush=True)
    lin_w = torch.randn(4096, 4096, device=dev, dtype=dt)
    x = torch.randn(1, 1, 4096, device=dev, dtype=dt)
    bias = torch.randn(4096, device=dev, dtype=dt)
    for label, fn in [("F.linear 4096x4096", lambda: torch.nn.functional.linear(x, lin_w)),
                      ("F.linear + bias", lambda: torch.nn.functional.linear(x, lin_w, bias)),
                      ("torch.matmul(x, W.t())", lambda: torch.matmul(x, lin_w.t())),
                      ("torch.addmm(bias, x2, W.t())", lambda: torch.addmm(bias, x.view(1, 4096), lin_w.t())),
                      ("torch.sigmoid (elementwise)", lambda: torch.sigmoid(x))]:
        print(f"  {label:55s} host {host_us(fn):6.1f} us  GPU {tuning.gpu_ms(fn) * 1e3:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
