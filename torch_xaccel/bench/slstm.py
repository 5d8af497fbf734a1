"""The slstm family's suite: the sequence op beside FlashRNN's kernels (when importable) and the
eager loop; the decode step; the xlstm package's xLSTMBlockStack with sLSTM blocks (prefill, train
step, one-token decode) against its CUDA sLSTM backend."""
from __future__ import annotations

import os
import re
import time
from unittest import mock

import torch

from torch_xaccel import families
from torch_xaccel.bench import common
from torch_xaccel.bench.common import Case, _bench, _empty_cache, _graphed, _ratios_to_first, _rel
from torch_xaccel.bench.model import xlstm_block_stack


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
    return Case(f"sLSTM B{B} T{T} NH{NH} D{D}{tag}", 2 * B * T * NH * 4 * D * D, make, runner=run_slstm_case)


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
                runner=run_slstm_decode_case)


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
    return Case(f"{name}, B{B} S{S}", 0, lambda: (E, blocks, tuple(slstm_at), B, S, heads), runner=run_slstm_model_case)


def slstm_model_decode(E=768, blocks=8, slstm_at=(7,), B=1):
    """One-token decode of the same stacks (xLSTMBlockStack.step, the state dict carried between
    calls) at batch B: the vanilla sLSTM compiled with xaccel (plainly and replayed from a CUDA
    graph) against the same model uncompiled and the package's cuda sLSTM backend uncompiled."""
    mix = "all-sLSTM" if len(slstm_at) == blocks else f"{blocks - len(slstm_at)}:{len(slstm_at)} mLSTM:sLSTM"
    return Case(f"xLSTMBlockStack {mix}, {blocks} blocks, E{E}: one-token decode B{B}", 0,
                lambda: (E, blocks, tuple(slstm_at), B), runner=run_slstm_model_decode_case)


def _slstm_stack(E, blocks, slstm_at, backend, B, S, heads=4):
    torch.manual_seed(0)
    return xlstm_block_stack(E, blocks, slstm_at, backend, B, S, heads).to("cuda", torch.bfloat16)



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
        if common.PATHS and not re.search(common.PATHS, label):
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


def cases(quick: bool) -> list[Case]:
    S = 256 if quick else 1024
    return [slstm_seq(16, S, 4, 192), slstm_seq(16, S, 1, 768),
            slstm_seq(16, 1024, 8, 128), slstm_seq(64, 1024, 4, 192), slstm_seq(64, 1024, 1, 768),
            slstm_seq(16, S, 4, 192, torch.float32), slstm_seq(16, S, 1, 768, torch.float32),
            slstm_decode(1), slstm_decode(8),
            slstm_model(768, 8, (7,), 16, S), slstm_model(768, 4, (0, 1, 2, 3), 16, S),
            # the widest embedding of the range: sLSTM heads of 256, mLSTM of 512
            slstm_model(2048, 8, (7,), 16, S, heads=8), slstm_model(2048, 4, (0, 1, 2, 3), 16, S, heads=8),
            *(slstm_model_decode(768, blocks, at, B) for blocks, at in ((8, (7,)), (4, (0, 1, 2, 3)))
              for B in (1, 8))]
