"""Side-by-side timings on the GPU, every path measured in one run:

    python -m torch_xaccel.bench causal_conv|gemm|group_norm|headwise|mlstm|model|skinny_linear|slstm
        [--out DIR] [--quick] [--no-max-autotune] [--only TEXT]

Prints one table (xaccel, eager, Inductor default, Inductor max-autotune, the cuBLAS matmuls
alone) with times, TFLOP/s and ratios, checks xaccel against an fp32 reference, and writes
DIR/bench_<suite>.md and DIR/bench_<suite>.png.

    python -m torch_xaccel.bench sweep [--quick] [--only TEXT] [--list] [--cpu] [--out DIR] ...

runs the performance differential harness instead (torch_xaccel/sweep: model forms x sizes x
dtypes x modes, eager vs Inductor vs xaccel, each row in its own process; `sweep --help`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable
from unittest import mock

import torch
import torch.nn.functional as F

from torch_xaccel import families
from torch_xaccel.codegen import tuning


@dataclass
class Case:
    name: str
    flop: float
    make: Callable  # () -> (fn, args, cublas_only_fn)
    train: bool = False
    # "compile": eager vs torch.compile; "mlstm"/"decode": op-level kernels; "model": xLSTMLarge
    runner: str = "compile"
    graphs: bool = False  # also time CUDA-graph replays (decode shapes: CPU launch cost hidden)
    baseline: str = "cuBLAS matmuls alone"  # what make()'s third function times: the case's floor
    rows: list = field(default_factory=list)


# do_bench's warmup and rep are milliseconds, not calls: budgets long enough that even a whole-model
# train step gets several warm-up and timed calls (a median over more than one; tests/test_bench.py)
BENCH_WARMUP_MS = {True: 300, False: 50}
BENCH_REP_MS = {True: 1000, False: 300}


def _ratios_to_first(rows: list) -> list:
    """rows with both ratio columns set to each row's time over the first row's (the runners whose
    first row is their reference)."""
    base = rows[0]["ms"] if rows else 1.0
    for r in rows:
        r["vs_cublas"], r["vs_xaccel"] = r["ms"] / base, r["ms"] / base
    return rows


def _bench(fn, train: bool, grad_to_none=None) -> float:
    """Median ms per call of fn (triton.testing.do_bench, L2 flushed before each call)."""
    return _bench_calls(fn, train, grad_to_none)[0]


def _bench_calls(fn, train: bool, grad_to_none=None) -> tuple[float, list]:
    """(median, every timed call's ms): the model rows print the spread beside the median."""
    if not torch.cuda.is_available():  # CPU smoke runs (`model --quick`): the code path, not a timing
        fn()
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, [ms]
    import triton.testing

    calls = triton.testing.do_bench(fn, warmup=BENCH_WARMUP_MS[train], rep=BENCH_REP_MS[train], return_mode="all",
                                    grad_to_none=grad_to_none)
    calls = calls.tolist() if hasattr(calls, "tolist") else calls  # a list, or a tensor in some Triton versions
    calls = [float(c) for c in calls] if isinstance(calls, (list, tuple)) else [float(calls)]
    return statistics.median(calls), calls


HEAT_S = 2.0


def _heat(fn, seconds: float = HEAT_S) -> None:
    """Run fn for `seconds` before the first timing of a case. An idle GPU boosts its clocks for
    the first GEMMs and throttles under sustained load: a row timed first, cold, would run faster
    than the rows after it and skew every ratio against them."""
    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()


def _graphed(fn):
    """fn captured in a CUDA graph after warm-up calls on a side stream: returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def gelu_residual(M, K=4096, N=16384):
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
        res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)

        def f(x, W, b, res):
            return F.gelu(F.linear(x, W, b), approximate="tanh") + res
        return f, (x, W, b, res), lambda: x @ W.t()
    return Case(f"gelu_tanh(linear(x,W,b))+res M{M} K{K} N{N}", 2 * M * N * K, make, graphs=M <= 256)


def swiglu(M, d=4096, h=11008):
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g) / s[-1] ** 0.5  # noqa: E731
        x, w1, w3, w2 = mk(M, d), mk(h, d), mk(h, d), mk(d, h)

        def f(x, w1, w3, w2):
            return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
        hid = torch.empty(M, h, device="cuda", dtype=torch.bfloat16)

        def cublas():
            torch.mm(x, w1.t(), out=hid)
            torch.mm(x, w3.t(), out=hid)
            return hid @ w2.t()
        return f, (x, w1, w3, w2), cublas
    return Case(f"SwiGLU MLP fwd M{M} {d}->2x{h}->{d}", 2 * M * d * h * 3, make)


def headwise(M, H=384, D=4, DO=4, train=False):
    """The xlstm package's q/k/v projection (LinearHeadwiseExpand, 384 heads of 4 x 4 at inner
    width 1536) over M rows, bf16; with train, forward + backward of a mean-square loss. The
    cuBLAS row is the batched GEMM that eager's einsum runs, on operands already permuted."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, H * D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(train)
        w = (torch.randn(H, DO, D, device="cuda", generator=g) / D ** 0.5).bfloat16().requires_grad_(train)

        def f(x, w):
            return torch.einsum("...hd,hod->...ho", x.view(M, H, D), w).reshape(M, H * DO)
        xp, wt = x.detach().view(M, H, D).transpose(0, 1).contiguous(), w.detach().transpose(1, 2).contiguous()

        def step(fn):
            def run():
                x.grad = w.grad = None
                fn(x, w).float().square().mean().backward()
            return run
        return f, (x, w), lambda: torch.bmm(xp, wt), step
    return Case(f"headwise einsum M{M}, {H} heads of {D}x{DO}{', train step' if train else ''}",
                2 * M * H * DO * D * (3 if train else 1), make, train=train)


def causal_conv(B, S, C=1536, K=4, train=False):
    """The xlstm package's CausalConv1d (the 7:1 stack's mLSTM convolution at inner width 1536,
    kernel size 4: its input a [B, S, C] slice seen as [B, C, S], the output transposed back),
    bf16; with train, forward + backward of a mean-square loss. The baseline row is one copy of x:
    the memory traffic a fused convolution cannot go below."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(B, S, 2 * C, device="cuda", dtype=torch.bfloat16, generator=g)[..., :C]
        x = x.detach().requires_grad_(train) if train else x
        w = (torch.randn(C, 1, K, device="cuda", generator=g) / K ** 0.5).bfloat16().requires_grad_(train)
        b = torch.randn(C, device="cuda", generator=g).bfloat16().requires_grad_(train)

        def f(x, w, b):
            return F.conv1d(x.transpose(1, 2), w, b, padding=K - 1, groups=C)[..., :-(K - 1)].transpose(1, 2)
        dense = x.detach().contiguous()

        def step(fn):
            def run():
                x.grad = w.grad = b.grad = None
                fn(x, w, b).float().square().mean().backward()
            return run
        return f, (x, w, b), lambda: dense.clone(), step
    return Case(f"causal conv1d B{B} S{S} C{C} K{K}{', train step' if train else ''}",
                2 * B * S * C * K * (3 if train else 1), make, train=train, baseline="one copy of x")


def group_norm(N, C=1536, G=4, train=False):
    """The xlstm package's MultiHeadLayerNorm (the 7:1 stack's mLSTM head norm: 4 heads of 384 over
    B16 S1024 rows, weight only), bf16; with train, forward + backward of a mean-square loss. The
    baseline row is one copy of x."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(N, C, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(train)
        w = (1 + 0.1 * torch.randn(C, device="cuda", generator=g)).bfloat16().requires_grad_(train)

        def f(x, w):
            return F.group_norm(x, G, w, None, 1e-5)
        dense = x.detach()

        def step(fn):
            def run():
                x.grad = w.grad = None
                fn(x, w).float().square().mean().backward()
            return run
        return f, (x, w), lambda: dense.clone(), step
    return Case(f"group norm N{N} C{C} G{G}{', train step' if train else ''}", 0, make, train=train,
                baseline="one copy of x")


def skinny_linear(M, width=1536, heads=4, train=False):
    """The xlstm package's mLSTM gates (the 7:1 stack's: igate and fgate of cat(q, k, v), 4 heads,
    q, k, v of 1536 over B16 S1024 rows), bf16; with train, forward + backward of a mean-square
    loss. The baseline row is one copy of q, k and v."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        qkv = [torch.randn(M, width, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(train)
               for _ in range(3)]
        ws = [(torch.randn(heads, 3 * width, device="cuda", generator=g) / 64).bfloat16().requires_grad_(train)
              for _ in range(2)]
        bs = [torch.randn(heads, device="cuda", generator=g).bfloat16().requires_grad_(train) for _ in range(2)]

        def f(q, k, v, wi, bi, wf, bf):
            x = torch.cat([q, k, v], -1)
            return F.linear(x, wi, bi) - F.linear(x, wf, bf)
        dense = torch.stack([t.detach() for t in qkv])

        def step(fn):
            def run():
                for t in (*qkv, *ws, *bs):
                    t.grad = None
                fn(*qkv, ws[0], bs[0], ws[1], bs[1]).float().square().mean().backward()
            return run
        return f, (*qkv, ws[0], bs[0], ws[1], bs[1]), lambda: dense.clone(), step
    return Case(f"mLSTM gates M{M} 3 x {width} -> 2 x {heads}{', train step' if train else ''}",
                2 * M * 3 * width * 2 * heads * (3 if train else 1), make, train=train, baseline="one copy of q, k, v")


def mlp_train(M, d=2048, h=8192, layers=4):
    def make():
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList()
        for _ in range(layers):
            blocks.append(torch.nn.Linear(d, h))
            blocks.append(torch.nn.Linear(h, d))
        blocks = blocks.to("cuda", torch.bfloat16)
        x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def f(x):
            for i in range(0, len(blocks), 2):
                x = blocks[i + 1](F.gelu(blocks[i](x), approximate="tanh")) + x
            return x

        def step(fn):
            def run():
                for p in blocks.parameters():
                    p.grad = None
                fn(x).float().square().mean().backward()
            return run
        ws = [(blk.weight) for blk in blocks]
        hid = torch.empty(M, h, device="cuda", dtype=torch.bfloat16)

        def cublas():  # the same GEMMs, forward and backward, with no elementwise work
            with torch.no_grad():
                for i in range(0, len(ws), 2):
                    torch.mm(x, ws[i].t(), out=hid)
                    y = hid @ ws[i + 1].t()
                    _ = y @ ws[i + 1], y.t() @ hid, hid @ ws[i], hid.t() @ x
        return f, (x,), cublas, step
    return Case(f"train step {layers}-layer MLP M{M} {d}->{h}->{d} (fwd+bwd)", 3 * 2 * M * d * h * 2 * layers, make,
                train=True)


def mlstm_fwd(B, NH, S, DK, DV):
    """Forward of the chunkwise mLSTM: the generated kernel beside the anchors that run here."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v = mk(B, NH, S, DK), mk(B, NH, S, DK), mk(B, NH, S, DV)
        i, f = mk(B, NH, S), 3.0 + mk(B, NH, S)
        return q, k, v, i, f
    # one read of q, k, v, gates and one write of h, bf16
    floor_bytes = 2 * (B * NH * S * (2 * DK + 2 * DV) + 2 * B * NH * S)
    return Case(f"mLSTM fwd B{B} NH{NH} S{S} DQK{DK} DV{DV}", floor_bytes, make, runner="mlstm")


def mlstm_decode(B, NH=8, DK=256, DV=512):
    """One recurrent step at the 7B head shape (the decode inner loop), plain and in a CUDA graph."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
        return ([mk(B, NH, DK).bfloat16(), mk(B, NH, DK).bfloat16(), mk(B, NH, DV).bfloat16(), mk(B, NH),
                 mk(B, NH) + 3],
                [mk(B, NH, DK, DV) * .1, mk(B, NH, DK) * .1, mk(B, NH)])
    floor_bytes = B * NH * (2 * DK * DV * 4 + 2 * DK * 4)  # read and write the fp32 state once
    return Case(f"mLSTM decode step B{B} NH{NH} DQK{DK} DV{DV}", floor_bytes, make, runner="decode")


def run_decode_case(case: Case) -> list:
    """Rows: xaccel step (Triton) plain and in a CUDA graph; the xlstm library's native and Triton
    steps when importable. 'TFLOP/s' is GB/s over the state's read + write."""
    x, state = case.make()
    rows = []

    def add(path, ms, extra=""):
        rows.append(dict(case=case.name, path=path, ms=ms, tflops=case.flop / ms / 1e9, extra=extra))
        print(f"  {path:40s} {ms * 1e3:9.1f} us  {case.flop / ms / 1e6:8.0f} GB/s of floor  {extra}", flush=True)

    print(f"\n{case.name}", flush=True)
    step = lambda: torch.ops.xaccel.mlstm_step(*x, *state, 1e-6, True)  # noqa: E731
    add("xaccel step", _bench(step, False))
    from torch_xaccel.ops.mlstm.op import run_step  # what a compiled graph calls, past the dispatcher
    add("xaccel step, direct call (compiled graphs)", _bench(lambda: run_step(*x, *state, 1e-6, True), False))
    graph = torch.cuda.CUDAGraph()
    step()
    with torch.cuda.graph(graph):
        step()
    add("xaccel step, CUDA graph", _bench(graph.replay, False))
    try:
        from mlstm_kernels.torch import get_mlstm_step_kernel

        m3 = state[2][..., None]
        for name in ("native", "triton"):
            kern = get_mlstm_step_kernel(name)
            add(f"xLSTM library step ({name})", _bench(lambda: kern(
                q=x[0], k=x[1], v=x[2], i=x[3][..., None], f=x[4][..., None], c=state[0], n=state[1], m=m3), False))
    except Exception as e:  # noqa: BLE001 - an anchor that cannot run is reported, not fatal
        print(f"  xLSTM library steps not run: {type(e).__name__}: {str(e)[:120]}")
    return _ratios_to_first(rows)


def run_mlstm_case(case: Case) -> list:
    """Rows: xaccel (torch.ops.xaccel.mlstm, Triton chunkwise forward; fwd+bwd through
    mlstm_with_chunk_states, which training graphs run, with .grad accumulating as the anchors'
    script measures, and reset to None before each call; and once through mlstm, which reruns the
    chunk-state scan in its backward), the xLSTM kernel library's
    triton_limit_chunk if it is importable (carry its wheels), causal SDPA on the same q/k/v when
    DQK == DV. 'TFLOP/s' here is GB/s over the memory floor (one read of inputs, one write of h)."""
    q, k, v, i, f = case.make()
    rows = []

    def add(path, ms, extra=""):
        rows.append(dict(case=case.name, path=path, ms=ms, tflops=case.flop / ms / 1e9, extra=extra))
        print(f"  {path:36s} {ms:9.3f} ms  {case.flop / ms / 1e6:8.0f} GB/s of floor  {extra}", flush=True)

    print(f"\n{case.name}  (memory floor {case.flop / 4.3e9:.3f} ms at 4.3 TB/s)", flush=True)
    from torch_xaccel.ops.mlstm import reference

    with torch.no_grad():
        sub = [t[:1, :2] for t in (q, k, v, i, f)]
        want = reference.forward(*(t.double() for t in sub))[0]
        got = torch.ops.xaccel.mlstm(*sub, None, None, None, 1e-6, 64)[0]
        err = ((got.double() - want).norm() / want.norm()).item()
        add("xaccel (Triton chunkwise fwd)",
            _bench(lambda: torch.ops.xaccel.mlstm(q, k, v, i, f, None, None, None, 1e-6, 64), False),
            f"rel err vs fp64 reference (B1 NH2 slice) {err:.1e}")
    leaves = [t.detach().requires_grad_() for t in (q, k, v, i, f)]
    qg, kg, vg, ig, fg = leaves

    def op_fwd_bwd(xs, op=torch.ops.xaccel.mlstm_with_chunk_states):
        def run():  # the op a compiled training graph runs: its backward reads the forward's chunk states
            h = op(*xs, None, None, None, 1e-6, 64)[0]
            h.backward(torch.ones_like(h))
        return run
    add("xaccel fwd+bwd", _bench(op_fwd_bwd(leaves), True))
    # .grad set to None before each call (as after optimizer.zero_grad()): no accumulation into old grads
    add("xaccel fwd+bwd, .grad reset", _bench(op_fwd_bwd(leaves), True, leaves))
    # xaccel.mlstm (inference graphs' op) under autograd: the backward reruns the chunk-state scan
    add("xaccel fwd+bwd, states recomputed, .grad reset", _bench(op_fwd_bwd(leaves, torch.ops.xaccel.mlstm), True,
                                                                  leaves))
    # the layout a model hands over: [B, S, H, D] projections viewed as [B, H, S, D] (read in place)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2).detach().requires_grad_() for t in (q, k, v, i, f)]
    add("xaccel fwd+bwd, transposed-view inputs, .grad reset", _bench(op_fwd_bwd(views), True, views))
    with torch.no_grad():
        try:
            from mlstm_kernels.torch import get_mlstm_kernel

            kern = get_mlstm_kernel("chunkwise--triton_limit_chunk")
            add("xLSTM library triton_limit_chunk (64)",
                _bench(lambda: kern(q=q, k=k, v=v, i=i, f=f, chunk_size=64), False))
            with torch.enable_grad():
                def lib_fwd_bwd():
                    h = kern(q=qg, k=kg, v=vg, i=ig, f=fg, chunk_size=64)
                    h.backward(torch.ones_like(h))
                add("xLSTM library fwd+bwd", _bench(lib_fwd_bwd, True))
                add("xLSTM library fwd+bwd, .grad reset", _bench(lib_fwd_bwd, True, leaves))
        except Exception as e:  # noqa: BLE001 - an anchor that cannot run is reported, not fatal
            print(f"  xLSTM library anchor not run: {type(e).__name__}: {str(e)[:120]}")
        if q.shape[-1] == v.shape[-1]:
            add("causal SDPA, same q/k/v", _bench(
                lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), False))
    return _ratios_to_first(rows)


def slstm_seq(B, T, NH, D, dtype=torch.bfloat16):
    """The sLSTM over a sequence (pre-activations given): the persistent kernel beside FlashRNN's
    kernels and the eager loop of the same math. fp32: what a hand-written fp32 loop compiles to."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        Wx = torch.randn(B, T, 4, NH, D, device="cuda", generator=g).to(dtype)
        R = (torch.randn(NH, 4, D, D, device="cuda", generator=g) / D ** 0.5).to(dtype)
        b = torch.randn(4, NH, D, device="cuda", generator=g)
        return Wx, R, b
    # per step: R [4 D x D] per head times h, for every batch row
    tag = "" if dtype == torch.bfloat16 else f" {str(dtype).removeprefix('torch.')}"
    return Case(f"sLSTM B{B} T{T} NH{NH} D{D}{tag}", 2 * B * T * NH * 4 * D * D, make, runner="slstm")


def run_slstm_case(case: Case) -> list:
    """Rows: xaccel::slstm forward and fwd+bwd with the xlstm package's variant (batch fresh rule,
    clamped gates), the eager loop of the same math, FlashRNN's backends when importable (carry its wheel; its layouts:
    R [4, NH, D, D], and n clamped at 1, which from a zero start changes nothing)."""
    from torch_xaccel.ops.slstm import reference

    Wx, R, b = case.make()
    rows = []

    def add(path, ms, extra=""):
        rows.append(dict(case=case.name, path=path, ms=ms, tflops=case.flop / ms / 1e9, extra=extra))
        print(f"  {path:44s} {ms:9.3f} ms  {case.flop / ms / 1e9:7.1f} TFLOP/s  {extra}", flush=True)

    print(f"\n{case.name}", flush=True)
    variant = ("batch", True, False)

    def op():
        return torch.ops.xaccel.slstm(Wx, R, b, None, None, None, None, *variant)

    exact = torch.float64 if Wx.dtype == torch.float32 else torch.float32  # the reference the error is against
    with torch.no_grad():
        want = reference.forward(Wx[:2, :64].to(exact), R.to(exact), b.to(exact), None, None, None, None, *variant)[0]
        got = torch.ops.xaccel.slstm(Wx[:2, :64], R, b, None, None, None, None, *variant)[0]
        err = _rel(got, want)
        full = op()[0]
    from torch_xaccel.codegen.slstm import cuda_kernels

    declined = cuda_kernels.why_not(Wx, R, b)
    kernel = None if declined else f"CUDA {cuda_kernels.plan(Wx)[0]}-exchange kernel"
    path = f"xaccel ({kernel}) fwd" if kernel else f"xaccel fwd: ATen reference ({declined})"
    add(path, _bench(op, False), f"rel err vs {str(exact).removeprefix('torch.')} reference (B2 T64) {err:.1e}")
    leaves = [t.detach().requires_grad_() for t in (Wx, R, b)]

    def fwd_bwd(op):
        def run():
            y = op(*leaves, None, None, None, None, *variant)[0]
            y.backward(torch.ones_like(y))
        return run
    bwd = kernel if cuda_kernels.backward_reads_kept_states(Wx, R) else "ATen reference"
    add(f"xaccel fwd+bwd ({bwd} backward)", _bench(fwd_bwd(torch.ops.xaccel.slstm_saving), True, leaves),
        "xaccel::slstm_saving, what training graphs run")
    add("xaccel fwd+bwd, forward rerun in the backward", _bench(fwd_bwd(torch.ops.xaccel.slstm), True, leaves),
        "xaccel::slstm called eagerly under autograd")
    with torch.no_grad():
        eager = lambda: reference.forward(Wx, R, b, None, None, None, None, *variant)  # noqa: E731
        add("eager loop (the reference's math)", _bench(eager, True))
    try:
        from flashrnn.flashrnn import flashrnn

        Rf = R.transpose(0, 1).contiguous()
        name = str(Wx.dtype).removeprefix("torch.")
        for backend in ("cuda", "cuda_fused"):
            try:
                run = lambda backend=backend: flashrnn(Wx, Rf, b.to(Wx.dtype), function="slstm",  # noqa: E731
                                                       backend=backend, dtype=name)
                t0 = time.perf_counter()
                h = run()[0][0]
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                add(f"FlashRNN {backend} fwd", _bench(run, False),
                    f"first call {first:.0f}s, rel err vs xaccel {_rel(h, full):.1e}")
                fl = [t.detach().requires_grad_() for t in (Wx, Rf, b.to(Wx.dtype))]

                def frnn_fwd_bwd(backend=backend, fl=fl):
                    h = flashrnn(*fl, function="slstm", backend=backend, dtype=name)[0][0]
                    h.backward(torch.ones_like(h))
                add(f"FlashRNN {backend} fwd+bwd", _bench(frnn_fwd_bwd, True, fl))
            except Exception as e:  # noqa: BLE001 - an anchor that cannot run is reported, not fatal
                print(f"  FlashRNN {backend} not run: {type(e).__name__}: {str(e)[:160]}")
    except ImportError as e:
        print(f"  FlashRNN anchors not run: {e}")
    return _ratios_to_first(rows)


def slstm_decode(B, NH=4, D=192):
    """One sLSTM step (the decode inner loop) at hidden 768, plain and in a CUDA graph."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        Wx = torch.randn(B, 4, NH, D, device="cuda", generator=g).bfloat16()
        R = (torch.randn(NH, 4, D, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
        b = torch.randn(4, NH, D, device="cuda", generator=g)
        state = [torch.randn(B, NH, D, device="cuda", generator=g) * .5 for _ in range(4)]
        state[2] = state[2].abs() + 1
        return Wx, R, b, state
    # read R once (bf16), read and write the fp32 state
    return Case(f"sLSTM decode step B{B} NH{NH} D{D}", NH * 4 * D * D * 2 + B * NH * D * 4 * 8, make,
                runner="slstm_decode")


def run_slstm_decode_case(case: Case) -> list:
    """Rows: xaccel::slstm_step (Triton) plain and in a CUDA graph, the reference step eagerly.
    'TFLOP/s' is GB/s over the floor (R read once, the state read and written)."""
    from torch_xaccel.ops.slstm import reference

    Wx, R, b, state = case.make()
    rows = []

    def add(path, ms, extra=""):
        rows.append(dict(case=case.name, path=path, ms=ms, tflops=case.flop / ms / 1e9, extra=extra))
        print(f"  {path:40s} {ms * 1e3:9.1f} us  {case.flop / ms / 1e6:8.0f} GB/s of floor  {extra}", flush=True)

    print(f"\n{case.name}", flush=True)
    variant = ("batch", True, False)
    step = lambda: torch.ops.xaccel.slstm_step(Wx, R, b, *state, *variant)  # noqa: E731
    with torch.no_grad():
        err = _rel(step()[0], reference.step(Wx, R.float(), b, *state, *variant)[0])
        add("xaccel step (Triton)", _bench(step, False), f"rel err vs fp32 reference {err:.1e}")
        add("xaccel step, CUDA graph", _bench(_graphed(step), False))
        add("eager reference step", _bench(lambda: reference.step(Wx, R, b, *state, *variant), False))
    return _ratios_to_first(rows)


def slstm_model(E=768, blocks=8, slstm_at=(7,), B=16, S=1024, heads=4):
    """The xlstm package's xLSTMBlockStack with sLSTM blocks (its sLSTM on the vanilla backend,
    compiled with xaccel, against the same model on the package's CUDA backend), bf16; `heads`
    for the sLSTM and the mLSTM layers alike."""
    mix = "all-sLSTM" if len(slstm_at) == blocks else f"{blocks - len(slstm_at)}:{len(slstm_at)} mLSTM:sLSTM"
    name = f"xLSTMBlockStack {mix}, {blocks} blocks, E{E}" + (f" {heads} heads" if heads != 4 else "")
    return Case(f"{name}, B{B} S{S}", 0, lambda: (E, blocks, tuple(slstm_at), B, S, heads), runner="slstm_model")


def slstm_model_decode(E=768, blocks=8, slstm_at=(7,), B=1):
    """One-token decode of the same stacks (xLSTMBlockStack.step, the state dict carried between
    calls) at batch B: the vanilla sLSTM compiled with xaccel (plainly and replayed from a CUDA
    graph) against the same model uncompiled and the package's cuda sLSTM backend uncompiled."""
    mix = "all-sLSTM" if len(slstm_at) == blocks else f"{blocks - len(slstm_at)}:{len(slstm_at)} mLSTM:sLSTM"
    return Case(f"xLSTMBlockStack {mix}, {blocks} blocks, E{E}: one-token decode B{B}", 0,
                lambda: (E, blocks, tuple(slstm_at), B), runner="slstm_model_decode")


def _slstm_stack(E, blocks, slstm_at, backend, B, S, heads=4):
    torch.manual_seed(0)
    return xlstm_block_stack(E, blocks, slstm_at, backend, B, S, heads).to("cuda", torch.bfloat16)


def xlstm_block_stack(E, blocks, slstm_at, backend, B, S, heads=4):
    """The xlstm package's xLSTMBlockStack (mLSTM blocks, sLSTM blocks at `slstm_at` on `backend`),
    in fp32 on the CPU, with random recurrent weights."""
    from xlstm import (
        mLSTMBlockConfig,
        mLSTMLayerConfig,
        sLSTMBlockConfig,
        sLSTMLayerConfig,
        xLSTMBlockStack,
        xLSTMBlockStackConfig,
    )

    cfg = xLSTMBlockStackConfig(
        mlstm_block=mLSTMBlockConfig(mlstm=mLSTMLayerConfig(conv1d_kernel_size=4, qkv_proj_blocksize=4,
                                                            num_heads=heads)),
        slstm_block=sLSTMBlockConfig(slstm=sLSTMLayerConfig(backend=backend, num_heads=heads, conv1d_kernel_size=4,
                                                            batch_size=B)),
        context_length=S, num_blocks=blocks, embedding_dim=E, slstm_at=list(slstm_at))
    model = xLSTMBlockStack(cfg)
    with torch.no_grad():  # the package initialises R to zeros: random recurrent weights exercise the recurrence
        for name, p in model.named_parameters():
            if "recurrent" in name:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return model


def run_slstm_model_case(case: Case) -> list:
    """Rows per configuration: prefill (inference mode) and train step (forward + backward of a
    mean-square loss), with the first call's time (compile, kernel builds and tuning) for the
    compiled ones. Configurations: the vanilla sLSTM compiled with xaccel (default settings, then
    with the rest of the graph fused by Inductor), the package's CUDA sLSTM backend uncompiled
    (its kernels build at construction). --paths narrows the configurations."""
    E, blocks, slstm_at, B, S, heads = case.make()
    rows = []

    def add(path, ms, extra=""):
        rows.append(dict(case=case.name, path=path, ms=ms, tflops=0.0, extra=extra))
        print(f"  {path:52s} {ms:9.3f} ms  {extra}", flush=True)

    print(f"\n{case.name}", flush=True)
    x = torch.randn(B, S, E, device="cuda", dtype=torch.bfloat16)
    for label, backend, compiled, env in (
            ("xaccel (vanilla sLSTM, compiled)", "vanilla", True, {}),
            ("xaccel, rest by Inductor (XACCEL_FALLBACK=inductor)", "vanilla", True, {"XACCEL_FALLBACK": "inductor"}),
            ("xaccel, elementwise ops left eager (XACCEL_PATTERNS without pointwise)", "vanilla", True,
             {"XACCEL_PATTERNS": ",".join(p for p in families.PATTERNS if p != "pointwise")}),
            ("xlstm CUDA sLSTM backend, uncompiled", "cuda", False, {})):
        if PATHS and not re.search(PATHS, label):
            continue
        try:
            t0 = time.perf_counter()
            model = _slstm_stack(E, blocks, slstm_at, backend, B, S, heads)
            built = f", model built in {time.perf_counter() - t0:.0f}s"
            with mock.patch.dict(os.environ, env):  # read at compile, which the first calls run
                _slstm_model_rows(label, model, compiled, x, add, built)
            model = None  # freed before the next configuration
        except Exception as e:  # noqa: BLE001 - a configuration that cannot run is a finding, not a crash
            print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        _empty_cache()
    return _ratios_to_first(rows)


def _slstm_model_rows(label, model, compiled, x, add, built) -> None:
    """Prefill and train-step rows of one built stack (compiled here when `compiled`)."""
    from torch_xaccel.report import last_report

    torch._dynamo.reset()
    fn = torch.compile(model, backend="xaccel") if compiled else model
    with torch.inference_mode():
        t0 = time.perf_counter()
        fn(x)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        counts = f", replaced {last_report().counts()}" if compiled else built
        add(f"{label}, prefill", _bench(lambda: fn(x), True), f"first call {first:.1f}s{counts}")

    def train():
        fn(x).float().square().mean().backward()
    t0 = time.perf_counter()
    train()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    add(f"{label}, train step", _bench(train, True, list(model.parameters())), f"first call {first:.1f}s")


def run_slstm_model_decode_case(case: Case) -> list:
    """Rows per configuration: one token plain (host and GPU time, what a caller without graphs
    pays) and in a CUDA graph, from the state a first token left."""
    E, blocks, slstm_at, B = case.make()
    rows = []

    def add(path, ms, extra=""):
        rows.append(dict(case=case.name, path=path, ms=ms, tflops=0.0, extra=extra))
        print(f"  {path:52s} {ms * 1e3:9.1f} us  {extra}", flush=True)

    print(f"\n{case.name}", flush=True)
    from torch_xaccel.report import last_report

    # only the compiled step is captured: the package's uncompiled steps (vanilla and cuda) fail
    # under capture and leave the process unable to capture again ("Offset increment outside graph
    # capture"), so they are timed plainly, after the compiled one
    for label, backend, compiled in (("xaccel (vanilla sLSTM, compiled)", "vanilla", True),
                                     ("xlstm vanilla sLSTM, uncompiled", "vanilla", False),
                                     ("xlstm CUDA sLSTM backend, uncompiled", "cuda", False)):
        try:
            model = _slstm_stack(E, blocks, slstm_at, backend, B, 1024).eval()
            x = torch.randn(B, 1, E, device="cuda", dtype=torch.bfloat16)
            torch._dynamo.reset()
            with torch.inference_mode():
                state = model.step(x)[1]
                fn = torch.compile(model.step, backend="xaccel") if compiled else model.step
                t0 = time.perf_counter()
                fn(x, state)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                counts = f", replaced {last_report().counts()}" if compiled else ""
                add(f"{label}, one token", _bench(lambda: fn(x, state), False), f"first call {first:.1f}s{counts}")
                if compiled:
                    add(f"{label}, one token, CUDA graph", _bench(_graphed(lambda: fn(x, state)), False))
            model = fn = state = None
            _empty_cache()
        except Exception as e:  # noqa: BLE001 - a configuration that cannot run is a finding, not a crash
            print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    return _ratios_to_first(rows)


# the xlstm package's kernel settings: its pure-PyTorch configuration, which xaccel compiles, and
# its own Triton kernels (the anchor); the benchmarks/ scripts use the same two
NATIVE_KERNELS = dict(chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
                      step_kernel="native")
ANCHOR_KERNELS = dict(chunkwise_kernel="chunkwise--triton_limit_chunk", sequence_kernel="native_sequence__triton",
                      step_kernel="triton")


def xlstm_model(B=4, S=2048, quick=False):
    """xLSTMLarge at 7B widths (embedding 4096, 8 heads, 4 blocks, vocab 50304), bf16: prefill, a
    train step and one-token decode latency at batch 1 and 8 (plain and in a CUDA graph), for the
    xlstm package's Triton configuration (the anchor) and its native configuration compiled with
    backend="xaccel". `--quick` shrinks it (and runs on a CPU as a smoke test of the code path)."""
    dims = dict(embedding_dim=4096, num_heads=8, num_blocks=4)
    if quick:
        dims = dict(embedding_dim=1024, num_heads=4, num_blocks=2) if torch.cuda.is_available() else \
            dict(embedding_dim=256, num_heads=2, num_blocks=2)
    return Case(f"xLSTMLarge {dims['embedding_dim']}x{dims['num_blocks']} B{B} S{S} bf16", B * S,
                lambda: (dims, B, S), runner="model")


def run_model_case(case: Case) -> list:
    """Rows per configuration: prefill (inference mode) and train step (fwd + bwd + CE loss), with
    first-call (compile) time. 'TFLOP/s' here is k tokens/s."""
    (dims, B, S), rows = case.make(), []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = torch.randint(0, 50304, (B, S), device=dev)

    def add(path, ms, extra="", tokens=None):
        tokens = tokens or case.flop
        rows.append(dict(case=case.name, path=path, ms=ms, tflops=tokens / ms / 1e3, extra=extra))
        print(f"  {path:52s} {ms:9.3f} ms  {tokens / ms:8.1f} k tok/s  {extra}", flush=True)

    native = NATIVE_KERNELS
    ro = {"mode": "reduce-overhead"}
    configs = {  # name: (the model's kernel settings, XACCEL_* set while it compiles, torch.compile kwargs)
        "xlstm Triton kernels (anchor)": (ANCHOR_KERNELS, {}, {}),
        "native kernels + xaccel": (native, {"XACCEL_FALLBACK": "eager"}, {}),
        "native kernels + xaccel, rest by Inductor": (native, {"XACCEL_FALLBACK": "inductor"}, {}),
        # CUDA graph trees inside the compiled function: decode rows (the default --paths skips them
        # for prefill and train, which are not launch-bound)
        "native kernels + xaccel, mode=reduce-overhead": (native, {"XACCEL_FALLBACK": "eager"}, ro),
        "native kernels + xaccel, rest by Inductor, mode=reduce-overhead":
            (native, {"XACCEL_FALLBACK": "inductor"}, ro),
    }
    for name, (kernels, env, kwargs) in configs.items():
        with mock.patch.dict(os.environ, env):  # restored afterwards, unset ones removed again
            _model_config_rows(name, kernels, dims, dev, tokens, add, kwargs)
    return _ratios_to_first(rows)


def _settle_cutlass(run) -> str:
    """After a cold first call with XACCEL_CUTLASS=1, CUTLASS kernels build in the background and
    their cases retune at a later call: wait for the builds, then retune in one untimed call, so
    the timing that follows is the steady state (and not a retune inside do_bench's warm-up)."""
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    t0 = time.perf_counter()
    cases = gemm_kernels.settle()
    if not cases:
        return ""
    run()
    _sync()
    return f", then {time.perf_counter() - t0:.0f}s for {cases} case(s)' background CUTLASS builds and their retuning"


def _model_config_rows(name, kernels, dims, dev, tokens, add, compile_kwargs) -> None:
    """Prefill, train step and decode rows of one configuration (those whose label matches --paths;
    with a torch.compile mode, decode rows only unless --paths names the others; the train step
    with its loss compiled too only when --paths names it)."""
    import torch._dynamo
    from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

    def wanted(label):
        if compile_kwargs and not PATHS and "decode" not in label:
            return False
        if "loss compiled" in label and not PATHS:  # opt-in: --paths names it
            return False
        return re.search(PATHS, f"{name}, {label}") is not None

    def loss(logits):  # the train step's loss, as a user writes it around the model
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    # "loss compiled": the same step with the cross-entropy inside the compiled function (xaccel:
    # model and loss in one torch.compile; the anchor: its loss alone compiled by Inductor), to
    # show what compiling the loss too is worth (the LM head's logits cast and softmax)
    for label, mode in (("prefill", "inference"), ("train step", "train"), ("train step, loss compiled", "train")):
        if not wanted(label):
            continue
        torch._dynamo.reset()
        try:
            # xlstm 2.0.6's train mode needs return_last_states=True (else the layer unpacks h)
            cfg = xLSTMLargeConfig(vocab_size=50304, chunk_size=64, mode=mode, return_last_states=mode == "train",
                                   **dims, **kernels)
            torch.manual_seed(0)
            model = xLSTMLarge(cfg).to(dev, torch.bfloat16)
            if "loss compiled" in label and "xaccel" in name:
                step = torch.compile(lambda t: loss(model(t)[0]), backend="xaccel", **compile_kwargs)
            elif "loss compiled" in label:
                compiled_loss = torch.compile(loss)
                step = lambda t: compiled_loss(model(t)[0])  # noqa: E731
            else:
                fn = torch.compile(model, backend="xaccel", **compile_kwargs) if "xaccel" in name else model
                step = lambda t: loss(fn(t)[0])  # noqa: E731
            if mode == "inference":
                def run():
                    with torch.inference_mode():
                        return fn(tokens)
            else:
                def run():
                    model.zero_grad(set_to_none=True)
                    step(tokens).backward()
            t0 = time.perf_counter()
            run()
            _sync()
            first = time.perf_counter() - t0
            extra = f"first call {first:.1f}s"
            if "xaccel" in name:
                extra += _settle_cutlass(run)
            ms, calls = _bench_calls(run, True)
            add(f"{name}, {label}", ms, f"{extra}; {len(calls)} timed calls, {min(calls):.1f}-{max(calls):.1f} ms")
        except Exception as e:  # noqa: BLE001 - a configuration that fails is a finding
            print(f"  {name}, {label}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        _empty_cache()
    for b in (1, 8):  # one-token latency after a 64-token prompt, plain and in a CUDA graph
        if not wanted(f"decode B{b}"):
            continue
        torch._dynamo.reset()
        try:
            cfg = xLSTMLargeConfig(vocab_size=50304, chunk_size=64, mode="inference", return_last_states=True,
                                   **dims, **kernels)
            torch.manual_seed(0)
            model = xLSTMLarge(cfg).to(dev, torch.bfloat16)
            fn = torch.compile(model, backend="xaccel", **compile_kwargs) if "xaccel" in name else model
            with torch.inference_mode():
                _, state = fn(torch.randint(0, 50304, (b, 64), device=dev))
                # a copy: under mode=reduce-overhead the prefill's outputs live in CUDA-graph memory
                # that a later run may reuse
                state = {blk: tuple(t.clone() for t in st) for blk, st in state.items()}
                tok = torch.randint(0, 50304, (b, 1), device=dev)
                t0 = time.perf_counter()
                fn(tok, state)
                _sync()
                first = time.perf_counter() - t0
                add(f"{name}, decode B{b} one token", _bench(lambda: fn(tok, state), False), f"first call {first:.1f}s",
                    tokens=b)
                if dev == "cuda" and not compile_kwargs:  # (reduce-overhead graphs itself)
                    add(f"{name}, decode B{b} one token, CUDA graph", _bench(_graphed(lambda: fn(tok, state)), False),
                        tokens=b)
        except Exception as e:  # noqa: BLE001
            print(f"  {name}, decode B{b}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        _empty_cache()


TRANSFORMERS_XLSTM = "transformers.models.xlstm.modeling_xlstm"


def transformers_xlstm_without_package():
    """transformers' xlstm module as a user without the xlstm package gets it (its in-file copy of
    the chunkwise, sequence and step kernels), also where the package is installed: the file
    imported afresh under another name (Dynamo looks functions up by module name) while
    transformers' availability check answers no and `import xlstm` fails."""
    import importlib.util

    import transformers

    name = TRANSFORMERS_XLSTM + "_without_xlstm"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, importlib.util.find_spec(TRANSFORMERS_XLSTM).origin)
        module = importlib.util.module_from_spec(spec)
        package = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "xlstm" or k.startswith("xlstm.")}
        sys.modules["xlstm"] = None  # import xlstm fails, as where it is not installed
        sys.modules[name] = module  # (its classes' docstrings are built from the module's file)
        try:
            with mock.patch.object(transformers.utils, "is_xlstm_available", lambda: False):
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        finally:
            del sys.modules["xlstm"]
            sys.modules.update(package)
    return sys.modules[name]


def transformers_cache(modeling, cache=None) -> dict:
    """The keyword that hands xLSTMForCausalLM its cache: `cache` from transformers 5.24 on,
    `cache_params` before."""
    import inspect

    key = "cache" if "cache" in inspect.signature(modeling.xLSTMForCausalLM.forward).parameters else "cache_params"
    return {key: cache}


def transformers_cache_of(output):
    """The cache an xLSTMForCausalLM call returned (`cache` or, before 5.24, `cache_params`)."""
    return output.get("cache", output.get("cache_params"))


def transformers_cache_copy(cache):
    """The cache with its state tensors copied: under mode="reduce-overhead" the prefill's outputs
    live in CUDA-graph memory that a later replay may overwrite."""
    cache.rnn_state = {layer: tuple(t.clone() for t in state) for layer, state in cache.rnn_state.items()}
    if isinstance(getattr(cache, "seqlen_offset", None), torch.Tensor):
        cache.seqlen_offset = cache.seqlen_offset.clone()
    return cache


def transformers_model(B=4, S=2048, quick=False):
    """transformers' xLSTMForCausalLM at 7B widths (hidden 4096, 8 heads, 4 blocks, vocab 50304),
    bf16, its in-file mLSTM kernels (the xlstm package hidden): eager (the anchor) against
    compiled with backend="xaccel"; prefill, train step and one-token decode through its cache."""
    dims = dict(hidden_size=4096, num_heads=8, num_blocks=4)
    if quick:
        dims = dict(hidden_size=1024, num_heads=4, num_blocks=2) if torch.cuda.is_available() else \
            dict(hidden_size=256, num_heads=2, num_blocks=2)
    return Case(f"transformers xLSTMForCausalLM {dims['hidden_size']}x{dims['num_blocks']} B{B} S{S} bf16, "
                "without the xlstm package", B * S, lambda: (dims, B, S), runner="transformers_model")


def run_transformers_model_case(case: Case) -> list:
    """Rows per configuration, as run_model_case: prefill (use_cache=True, as generate() runs it:
    without a cache transformers' bf16 inference path fails eagerly, its fp32 zero start states
    meeting bf16 keys), train step (cross-
    entropy of the logits, backward) and one-token decode at batch 1 and 8 after a 64-token
    prompt, plain (and, eagerly, also replayed from a CUDA graph)."""
    (dims, B, S), rows = case.make(), []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = torch.randint(0, 50304, (B, S), device=dev)
    modeling = transformers_xlstm_without_package()

    def add(path, ms, extra="", tokens=None):
        tokens = tokens or case.flop
        rows.append(dict(case=case.name, path=path, ms=ms, tflops=tokens / ms / 1e3, extra=extra))
        print(f"  {path:52s} {ms:9.3f} ms  {tokens / ms:8.1f} k tok/s  {extra}", flush=True)

    print(f"\n{case.name}", flush=True)
    ro = {"mode": "reduce-overhead"}
    configs = {  # name: (XACCEL_* set while it compiles, torch.compile kwargs; None: uncompiled)
        "transformers eager (anchor)": ({}, None),
        "transformers + xaccel": ({"XACCEL_FALLBACK": "eager"}, {"backend": "xaccel"}),
        "transformers + xaccel, rest by Inductor": ({"XACCEL_FALLBACK": "inductor"}, {"backend": "xaccel"}),
        "transformers + xaccel, mode=reduce-overhead": ({"XACCEL_FALLBACK": "eager"}, {"backend": "xaccel", **ro}),
        "transformers + Inductor, mode=reduce-overhead": ({}, ro),
    }
    for name, (env, kwargs) in configs.items():
        with mock.patch.dict(os.environ, env):
            _transformers_config_rows(modeling, name, kwargs, dims, dev, tokens, add)
    return _ratios_to_first(rows)


def _transformers_config_rows(modeling, name, compile_kwargs, dims, dev, tokens, add) -> None:
    """One configuration's rows (those --paths selects; under a torch.compile mode decode only)."""
    import torch._dynamo

    def wanted(label):
        if compile_kwargs and "mode" in compile_kwargs and not PATHS and "decode" not in label:
            return False
        return re.search(PATHS, f"{name}, {label}") is not None

    def build(mode):
        cfg = modeling.xLSTMConfig(vocab_size=50304, chunk_size=64, mode=mode, use_cache=False, **dims)
        torch.manual_seed(0)
        model = modeling.xLSTMForCausalLM(cfg).to(dev, torch.bfloat16)
        return model, (model if compile_kwargs is None else torch.compile(model, **compile_kwargs))

    def timed_first(run) -> str:
        """The first call's time, and what the graphs it compiled replaced."""
        from torch_xaccel.report import Report, last_report

        before = len(last_report().graphs)
        t0 = time.perf_counter()
        run()
        _sync()
        first = f"first call {time.perf_counter() - t0:.1f}s"
        counts = Report(graphs=last_report().graphs[before:]).counts()
        return first + (f", replaced {({k: v for k, v in counts.items() if v})}" if compile_kwargs else "")

    for label, mode in (("prefill", "inference"), ("train step", "train")):
        if not wanted(label):
            continue
        torch._dynamo.reset()
        try:
            model, fn = build(mode)
            if mode == "inference":
                model.eval()

                def run():
                    with torch.inference_mode():
                        return fn(tokens, use_cache=True).logits
            else:
                model.train()

                def run():
                    model.zero_grad(set_to_none=True)
                    logits = fn(tokens).logits
                    F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
            extra = timed_first(run) + (_settle_cutlass(run) if compile_kwargs else "")
            ms, calls = _bench_calls(run, True)
            add(f"{name}, {label}", ms, f"{extra}; {len(calls)} timed calls, {min(calls):.1f}-{max(calls):.1f} ms")
        except Exception as e:  # noqa: BLE001 - a configuration that fails is a finding
            print(f"  {name}, {label}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        model = fn = None
        _empty_cache()
    for b in (1, 8):
        if not wanted(f"decode B{b}"):
            continue
        torch._dynamo.reset()
        try:
            model, fn = build("inference")
            model.eval()
            with torch.inference_mode():
                prompt = fn(torch.randint(0, 50304, (b, 64), device=dev), use_cache=True)
                cache = transformers_cache_copy(transformers_cache_of(prompt))
                tok = torch.randint(0, 50304, (b, 1), device=dev)
                kw = dict(use_cache=True, **transformers_cache(modeling, cache))

                def step():
                    return fn(tok, **kw).logits
                extra = timed_first(step)
                add(f"{name}, decode B{b} one token", _bench(step, False), extra, tokens=b)
                if dev == "cuda" and compile_kwargs is None:
                    add(f"{name}, decode B{b} one token, CUDA graph", _bench(_graphed(step), False), tokens=b)
        except Exception as e:  # noqa: BLE001
            print(f"  {name}, decode B{b}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        model = fn = None
        _empty_cache()


PATHS = ""  # --paths: a regular expression; the model suite runs only the rows whose label it finds

SUITES = {
    "gemm": lambda quick: ([gelu_residual(4096 if quick else 16384), gelu_residual(128),
                            swiglu(4096 if quick else 16384), mlp_train(4096 if quick else 16384)]),
    "headwise": lambda quick: [headwise(2048 if quick else 16384), headwise(2048 if quick else 16384, train=True)],
    "group_norm": lambda quick: [group_norm(2048 if quick else 16384),
                                 group_norm(2048 if quick else 16384, train=True)],
    "skinny_linear": lambda quick: [skinny_linear(2048 if quick else 16384),
                                    skinny_linear(2048 if quick else 16384, train=True)],
    "causal_conv": lambda quick: [causal_conv(2 if quick else 16, 1024),
                                  causal_conv(2 if quick else 16, 1024, train=True)],
    "model": lambda quick: ([xlstm_model(quick=True, B=2, S=512 if torch.cuda.is_available() else 128),
                             transformers_model(quick=True, B=2, S=512 if torch.cuda.is_available() else 128)]
                            if quick else [xlstm_model(), transformers_model()]),
    "mlstm": lambda quick: [mlstm_fwd(8, 16, 2048 if quick else 8192, 128, 128),
                            mlstm_fwd(8, 8, 1024 if quick else 4096, 256, 512),
                            mlstm_decode(1), mlstm_decode(8)],
    "slstm": lambda quick: [slstm_seq(16, 256 if quick else 1024, 4, 192),
                            slstm_seq(16, 256 if quick else 1024, 1, 768),
                            slstm_seq(16, 1024, 8, 128), slstm_seq(64, 1024, 4, 192), slstm_seq(64, 1024, 1, 768),
                            slstm_seq(16, 256 if quick else 1024, 4, 192, torch.float32),
                            slstm_seq(16, 256 if quick else 1024, 1, 768, torch.float32),
                            slstm_decode(1), slstm_decode(8),
                            slstm_model(768, 8, (7,), 16, 256 if quick else 1024),
                            slstm_model(768, 4, (0, 1, 2, 3), 16, 256 if quick else 1024),
                            # the widest embedding of the range: sLSTM heads of 256, mLSTM of 512
                            slstm_model(2048, 8, (7,), 16, 256 if quick else 1024, heads=8),
                            slstm_model(2048, 4, (0, 1, 2, 3), 16, 256 if quick else 1024, heads=8),
                            *(slstm_model_decode(768, blocks, at, B) for blocks, at in ((8, (7,)), (4, (0, 1, 2, 3)))
                              for B in (1, 8))],
}


GPU_TIME_NOTE = "GPU time of 20 calls queued behind a GPU sleep: no L2 flush between calls, CPU launch cost hidden"


def run_case(case: Case, max_autotune: bool) -> list:
    import torch._dynamo

    made = case.make()
    fn, args, cublas = made[:3]
    step = made[3] if case.train else (lambda f: (lambda: f(*args)))
    rows = []

    def add(path, ms, extra=""):
        rows.append(dict(case=case.name, path=path, ms=ms, tflops=case.flop / ms / 1e9, extra=extra))
        print(f"  {path:28s} {ms:9.3f} ms  {case.flop / ms / 1e9:7.1f} TFLOP/s  {extra}", flush=True)

    print(f"\n{case.name}", flush=True)
    _heat(cublas)
    add(case.baseline, _bench(cublas, case.train))
    back_to_back = not case.train and not case.graphs and torch.cuda.is_available()
    if back_to_back:  # diagnostic: GPU time alone, to tell kernel time from per-call CPU cost
        add(f"{case.baseline}, back to back", tuning.gpu_ms(cublas), GPU_TIME_NOTE)
    add("eager", _bench(step(fn), case.train))
    paths = [("xaccel", dict(backend="xaccel")), ("inductor default", dict())]
    if max_autotune and not case.train:
        paths.append(("inductor max-autotune", dict(mode="max-autotune-no-cudagraphs")))
    def graphed(fn):
        return _graphed(lambda: fn(*args))

    if case.graphs:
        add("eager, CUDA graph", _bench(graphed(fn), False))
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    for path, kw in paths:
        torch._dynamo.reset()
        before = dict(gemm_kernels._DECISIONS)
        try:
            compiled = torch.compile(fn, **kw)
            t0 = time.perf_counter()
            step(compiled)()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            extra = f"first call {compile_s:.1f}s"
            if path == "xaccel" and not case.train:
                with torch.no_grad():
                    ref = fn(*[a.float() for a in args])
                    extra += f", rel err vs fp32 {_rel(compiled(*args), ref):.1e}"
            if path == "xaccel":
                from torch_xaccel.report import last_report
                extra += f", replaced {({k: v for k, v in last_report(1).counts().items() if v}) or 'nothing'}"
                picked = [("ATen" if v is None else "/".join(map(str, v))) for k, v in gemm_kernels._DECISIONS.items()
                          if k not in before]
                extra += f", kernels: {'; '.join(picked) or 'cached'}"
            add(path, _bench(step(compiled), case.train), extra)
            if back_to_back and path == "xaccel":
                add("xaccel, back to back", tuning.gpu_ms(step(compiled)), GPU_TIME_NOTE)
            if case.graphs and path == "xaccel":
                add("xaccel, CUDA graph", _bench(graphed(compiled), False))
        except Exception as e:  # noqa: BLE001 - a failing path is a finding, not a crash
            print(f"  {path:28s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    if not case.graphs:  # the first row again, after everything else: how far the clocks moved meanwhile
        add(f"{case.baseline}, again", _bench(cublas, case.train), "measured last, as a check of the first row")
    base = rows[0]["ms"]
    xa = next((r["ms"] for r in rows if r["path"] == "xaccel"), None)
    for r in rows:
        r["vs_cublas"] = r["ms"] / base
        r["vs_xaccel"] = r["ms"] / xa if xa else None
    return rows


def markdown(rows, header: str) -> str:
    out = [header, "", "| case | path | ms | TFLOP/s (GB/s of floor for mLSTM) | x first row | x xaccel | notes |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        vx = f"{r['vs_xaccel']:.2f}" if r["vs_xaccel"] else "-"
        out.append(f"| {r['case']} | {r['path']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['vs_cublas']:.3f} | {vx} "
                   f"| {r['extra']} |")
    return "\n".join(out) + "\n"


def plot(rows, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    cases = list(dict.fromkeys(r["case"] for r in rows))
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4 + 0.4 * len(cases)))
    width = 0.8 / len(paths)
    for i, p in enumerate(paths):
        ys = [next((r["vs_cublas"] for r in rows if r["case"] == c and r["path"] == p), 0) for c in cases]
        ax.barh([j + i * width for j in range(len(cases))], ys, height=width, label=p)
    ax.set_yticks([j + 0.4 - width / 2 for j in range(len(cases))], [c[:48] for c in cases], fontsize=8)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("time / cuBLAS matmuls alone (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sweep"]:  # its own options: torch_xaccel/sweep/run.py
        from torch_xaccel.sweep import run as sweep

        return sweep.main(argv[1:])
    p = argparse.ArgumentParser(description="torch_xaccel side-by-side benchmarks (and `sweep`: see sweep --help)")
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--quick", action="store_true", help="smaller shapes")
    p.add_argument("--no-max-autotune", action="store_true")
    p.add_argument("--only", default="", help="run only the cases whose name contains this text")
    p.add_argument("--paths", default="",
                   help="model suite: only the rows whose label "
                   "('<configuration>, <prefill|train step|decode B1|decode B8>') "
                   "this regular expression finds")
    args = p.parse_args(argv)
    global PATHS
    try:
        re.compile(args.paths)
    except re.error as e:
        p.error(f"--paths {args.paths!r} is not a regular expression: {e}")
    PATHS = args.paths
    # these suites measure the replacements themselves (sweep measures the default, the measured choice)
    os.environ.setdefault("XACCEL_CHOOSE", "0")
    if args.suite == "gemm":  # CUTLASS kernels built before tuning, so every call is timed with them
        os.environ.setdefault("XACCEL_CUTLASS", "wait")
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
    for case in SUITES[args.suite](args.quick):
        if args.only not in case.name:
            continue
        runner = {"mlstm": run_mlstm_case, "model": run_model_case, "decode": run_decode_case,
                  "slstm": run_slstm_case, "slstm_decode": run_slstm_decode_case,
                  "slstm_model": run_slstm_model_case,
                  "slstm_model_decode": run_slstm_model_decode_case,
                  "transformers_model": run_transformers_model_case}.get(case.runner)
        rows += runner(case) if runner else run_case(case, not args.no_max_autotune)
        _empty_cache()
    if not rows:
        names = [c.name for c in SUITES[args.suite](args.quick)]
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


def tuning_report(since: float) -> str:
    """Every tuning decision written since `since`: each candidate's time (or why it was
    skipped), so a benchmark run also says which kernel variant won and by how much."""
    from torch_xaccel.codegen import cache

    lines = []
    for path in sorted((cache.root() / "tuning").glob("*.json"), key=os.path.getmtime):
        if os.path.getmtime(path) < since:
            continue
        try:
            data = json.loads(path.read_text())
            key, value = data["key"], data["value"]
            rows = [f"  - {why}" if cfg == "decided by"
                    else f"  - {ms if ms is not None else 'skipped'} ms  {cfg}  {why}".rstrip()
                    for cfg, ms, why in value.get("timings", [])]
            lines += [f"- `{key.split('|torch')[0]}` -> {value.get('config')}", *rows]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # not a tuning entry this report can read
    return "tuning decisions of this run:\n" + "\n".join(lines) if lines else ""


if __name__ == "__main__":
    sys.exit(main())
