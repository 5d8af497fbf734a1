"""The mlstm family's suite: the chunkwise forward and forward + backward beside the xLSTM kernel
library (when importable) and causal SDPA; the decode step plain and in a CUDA graph."""
from __future__ import annotations

import torch

from torch_xaccel.bench.common import Case, _bench, _ratios_to_first


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
    return Case(f"mLSTM fwd B{B} NH{NH} S{S} DQK{DK} DV{DV}", floor_bytes, make, runner=run_mlstm_case)


def mlstm_decode(B, NH=8, DK=256, DV=512):
    """One recurrent step at the 7B head shape (the decode inner loop), plain and in a CUDA graph."""
    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
        return ([mk(B, NH, DK).bfloat16(), mk(B, NH, DK).bfloat16(), mk(B, NH, DV).bfloat16(), mk(B, NH),
                 mk(B, NH) + 3],
                [mk(B, NH, DK, DV) * .1, mk(B, NH, DK) * .1, mk(B, NH)])
    floor_bytes = B * NH * (2 * DK * DV * 4 + 2 * DK * 4)  # read and write the fp32 state once
    return Case(f"mLSTM decode step B{B} NH{NH} DQK{DK} DV{DV}", floor_bytes, make, runner=run_decode_case)


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
    mlstm_saving, which training graphs run, with .grad accumulating as the anchors'
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

    def op_fwd_bwd(xs, op=torch.ops.xaccel.mlstm_saving):
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


def cases(quick: bool) -> list[Case]:
    return [mlstm_fwd(8, 16, 2048 if quick else 8192, 128, 128), mlstm_fwd(8, 8, 1024 if quick else 4096, 256, 512),
            mlstm_decode(1), mlstm_decode(8)]
