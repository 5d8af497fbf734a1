"""xaccel::mlstm — the matrix-memory LSTM over a sequence, with optional initial and final states.

Semantics (per batch and head; k is scaled by 1/sqrt(DQK); logf = logsigmoid(f)):

    Fc[t]   = logf[1] + ... + logf[t]
    logD    = Fc[t] - Fc[s] + i[s]             for s <= t
    m[t]    = max(Fc[t] + m0, max_s logD[t, s])
    num[t]  = exp(Fc[t] + m0 - m[t]) q_t C0  + sum_s exp(logD[t, s] - m[t]) (q_t . k_s) v_s
    den[t]  = exp(Fc[t] + m0 - m[t]) q_t n0  + sum_s exp(logD[t, s] - m[t]) (q_t . k_s)
    h[t]    = num[t] / (max(|den[t]|, exp(-m[t])) + eps)

Without an initial state, m0 = -inf and C0 = n0 = 0: this is exactly the stabilized parallel form.
The recurrent step form (states start at zeros with m0 = 0) is this op with the initial state
(0, 0, 0). The final state (C, n, m) is the recurrent state after the last step, in the same
stabilized convention (true C = exp(m) * C). Forms differ only through m0 (eps-level effects).

The reference below evaluates this chunk by chunk (chunk_size positions in parallel, a scan over
chunks), in fp32 (float64 stays float64); it is the CPU path, the kernels' oracle and the ONNX
body. S needs no relation to the chunk size: the tail is padded with positions that change
nothing (logf = 0, i = -inf-like).

xaccel::mlstm_with_chunk_states is the same op that also returns the state entering every chunk
of chunk_size positions (in the kernels' layout) and each row's den[t] and m[t] at that chunking;
its backward reads them instead of rerunning the sequential state scan and q k^T. The lowering uses it when the graph trains and the kernels' backward would
read them (lowering.keep_mlstm_chunk_states), at the cost of holding those states until the
backward (DQK/chunk_size x v's size; XACCEL_MLSTM_KEEP_STATES=0 declines).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import runtime

_NEG = -1e30  # input gate of padded positions: exp(_NEG - m) == 0 without creating inf - inf


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def reference(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C0: Tensor | None = None,
              n0: Tensor | None = None, m0: Tensor | None = None, eps: float = 1e-6,
              chunk_size: int = 64, keep_chunk_states: bool = False) -> tuple[Tensor, ...]:
    """(h [B,H,S,DV] in q's dtype, C [B,H,DQK,DV], n [B,H,DQK], m [B,H]) — states in fp32/fp64;
    keep_chunk_states adds the state entering each chunk: C [B,H,NC,DQK,DV] in q's dtype, n and m
    in fp32/fp64, and each row's (den[t], m[t]) [B,H,2,S] in fp32/fp64 (the kernels' layout;
    chunk_states_shapes)."""
    B, H, S, DK = q.shape
    DV = v.shape[-1]
    out_dtype, cd = q.dtype, _compute_dtype(q)
    L = chunk_size
    pad = (-S) % L
    q, k, v, i, f = (t.to(cd) for t in (q, k, v, i, f))
    k = k * DK ** -0.5
    logf = F.logsigmoid(f)
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        logf = F.pad(logf, (0, pad))
        i = F.pad(i, (0, pad), value=_NEG)
    if C0 is None:
        C = q.new_zeros(B, H, DK, DV)
        n = q.new_zeros(B, H, DK)
        m = q.new_full((B, H), float("-inf"))
    else:
        C, n, m = C0.to(cd), n0.to(cd), m0.to(cd)
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    hs, entering, rows = [], [], []
    for c in range(0, S + pad, L):
        if keep_chunk_states:
            entering.append((C, n, m))
        qc, kc, vc, ic = q[:, :, c:c + L], k[:, :, c:c + L], v[:, :, c:c + L], i[:, :, c:c + L]
        b = logf[:, :, c:c + L].cumsum(-1)                                   # [B,H,L]
        logD = (b[..., :, None] - b[..., None, :] + ic[..., None, :]).masked_fill(~causal, float("-inf"))
        inter = b + m[..., None]                                             # log weight of the state
        m_t = torch.maximum(inter, logD.amax(-1))                            # [B,H,L]
        w_inter = torch.exp(inter - m_t)
        Dm = torch.exp(logD - m_t[..., None])                                # [B,H,L,L]
        Cqk = (qc @ kc.transpose(-1, -2)) * Dm
        num = w_inter[..., None] * (qc @ C) + Cqk @ vc
        den = w_inter * (qc @ n[..., None]).squeeze(-1) + Cqk.sum(-1)
        hs.append(num / (torch.maximum(den.abs(), torch.exp(-m_t)) + eps)[..., None])
        if keep_chunk_states:
            rows.append(torch.stack((den, m_t), dim=2))                      # [B,H,2,L]
        g = b[..., -1]                                                       # whole-chunk log forget
        log_w = g[..., None] - b + ic                                        # [B,H,L]
        m_new = torch.maximum(g + m, log_w.amax(-1))
        decay, w = torch.exp(g + m - m_new), torch.exp(log_w - m_new[..., None])
        C = decay[..., None, None] * C + (kc * w[..., None]).transpose(-1, -2) @ vc
        n = decay[..., None] * n + (kc * w[..., None]).sum(-2)
        m = m_new
    h = torch.cat(hs, dim=2)[:, :, :S]
    if keep_chunk_states:
        Cs, ns, ms = (torch.stack(t, dim=2) for t in zip(*entering))
        return h.to(out_dtype), C, n, m, Cs.to(out_dtype), ns, ms, torch.cat(rows, dim=3)[..., :S].contiguous()
    return h.to(out_dtype), C, n, m


def chunk_states_shapes(q: Tensor, v: Tensor, chunk_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of mlstm_with_chunk_states' extra outputs: the states entering each chunk,
    C [B,H,NC,DQK,DV] in q's dtype (as the kernels store it), n [B,H,NC,DQK], m [B,H,NC], and each
    row's (den[t], m[t]) [B,H,2,S] under that chunking."""
    B, H, S, DK = q.shape
    NC, cd = -(-S // chunk_size), _compute_dtype(q)
    return [((B, H, NC, DK, v.shape[-1]), q.dtype), ((B, H, NC, DK), cd), ((B, H, NC), cd), ((B, H, 2, S), cd)]


def parallel_oracle(q, k, v, i, f, C0=None, n0=None, m0=None, eps=1e-6):
    """The defining formula above, O(S^2) memory: a test oracle for the chunkwise reference."""
    cd = _compute_dtype(q)
    q, k, v, i, f = (t.to(cd) for t in (q, k, v, i, f))
    S, DK = q.shape[-2], q.shape[-1]
    k = k * DK ** -0.5
    Fc = F.logsigmoid(f).cumsum(-1)
    logD = Fc[..., :, None] - Fc[..., None, :] + i[..., None, :]
    logD = logD.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    inter = Fc + (m0.to(cd)[..., None] if m0 is not None else float("-inf"))
    m = torch.maximum(inter, logD.amax(-1))
    Cqk = (q @ k.transpose(-1, -2)) * torch.exp(logD - m[..., None])
    num, den = Cqk @ v, Cqk.sum(-1)
    if C0 is not None:
        w = torch.exp(inter - m)
        num = num + w[..., None] * (q @ C0.to(cd))
        den = den + w * (q @ n0.to(cd)[..., None]).squeeze(-1)
    return num / (torch.maximum(den.abs(), torch.exp(-m)) + eps)[..., None]


def _recompute_grads(fn, inputs, outputs_grads):
    """Gradients by re-running `fn` on detached inputs under autograd (mlstm_step's backward; the
    sequence op has an analytic one in mlstm_backward.py)."""
    leaves = [t.detach().requires_grad_(True) if t is not None and t.is_floating_point() else None for t in inputs]
    with torch.enable_grad():
        outs = fn(*leaves)
    pairs = [(o, g) for o, g in zip(outs, outputs_grads) if g is not None and o.requires_grad]
    wanted = [t for t in leaves if t is not None]
    if not pairs:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
    return [next(got) if t is not None else None for t in leaves]


OP_NAME = "mlstm"
SAVING_OP_NAME = "mlstm_with_chunk_states"


def case_key(q, k, v, i, f, C0, n0, m0, eps, chunk_size) -> tuple:
    return (q.device.type, q.dtype, q.shape, v.shape, C0 is not None)


def _triton_kernels(key, q, *args):
    """Generated Triton chunkwise forward (codegen/triton_mlstm.py) on CUDA, or under the interpreter."""
    if not runtime.kernels_can_run(q):
        return NotImplemented
    from ..codegen import triton_mlstm

    return triton_mlstm.forward(key, q, *args)


def _triton_kernels_saving(key, q, *args):
    """The same forward, also returning the chunk states it computed (at the op's chunk_size)."""
    if not runtime.kernels_can_run(q):
        return NotImplemented
    from ..codegen import triton_mlstm

    return triton_mlstm.forward(key, q, *args, keep_chunk_states=True)


def _reference_saving(*args):
    return reference(*args, keep_chunk_states=True)


def run(q, k, v, i, f, C0, n0, m0, eps, chunk_size):
    """Outputs are contiguous whatever path ran, as the fake function promises."""
    outs = runtime.dispatch(OP_NAME, case_key, reference, q, k, v, i, f, C0, n0, m0, eps, chunk_size)
    return tuple(o.contiguous() for o in outs)


@torch.library.custom_op("xaccel::mlstm", mutates_args=())
def mlstm(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C0: Tensor | None, n0: Tensor | None,
          m0: Tensor | None, eps: float, chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return run(q, k, v, i, f, C0, n0, m0, eps, chunk_size)


@torch.library.custom_op("xaccel::mlstm_with_chunk_states", mutates_args=())
def mlstm_with_chunk_states(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C0: Tensor | None,
                            n0: Tensor | None, m0: Tensor | None, eps: float, chunk_size: int
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """xaccel::mlstm plus the state entering each chunk (C, n, m per chunk) and each row's den and
    m (chunk_states_shapes), which its backward reads instead of recomputing them: the op a training graph runs where the
    kernels' backward reads them. Those and the final state are saved for the backward, so
    modifying any of them in place before it raises autograd's version error (as for any saved
    output)."""
    outs = runtime.dispatch(SAVING_OP_NAME, case_key, _reference_saving, q, k, v, i, f, C0, n0, m0, eps, chunk_size)
    return tuple(o.contiguous() for o in outs)


runtime.register_provider(OP_NAME, _triton_kernels)
runtime.register_provider(SAVING_OP_NAME, _triton_kernels_saving)


@mlstm.register_fake
def _fake(q, k, v, i, f, C0, n0, m0, eps, chunk_size):
    B, H, S, DK = q.shape
    cd = _compute_dtype(q)
    return (q.new_empty(B, H, S, v.shape[-1]), q.new_empty(B, H, DK, v.shape[-1], dtype=cd),
            q.new_empty(B, H, DK, dtype=cd), q.new_empty(B, H, dtype=cd))


@mlstm_with_chunk_states.register_fake
def _fake_saving(q, k, v, i, f, C0, n0, m0, eps, chunk_size):
    kept = tuple(q.new_empty(shape, dtype=dtype) for shape, dtype in chunk_states_shapes(q, v, chunk_size))
    return _fake(q, k, v, i, f, C0, n0, m0, eps, chunk_size) + kept


def _setup_context(ctx, inputs, output):
    q, k, v, i, f, C0, n0, m0, eps, chunk_size = inputs
    ctx.has_state = C0 is not None
    # the output h too: the backward kernels read h . dh instead of recomputing the numerator;
    # with kept chunk states, those and the final state (the backward's scan needs neither rerun)
    kept = tuple(output[4:8]) + tuple(output[1:4]) if len(output) > 4 else ()
    if kept:
        ctx.mark_non_differentiable(*output[4:8])  # saved for the backward, not results
    ctx.n_kept = len(kept)
    ctx.save_for_backward(q, k, v, i, f, output[0], *kept, *((C0, n0, m0) if ctx.has_state else ()))
    ctx.eps, ctx.chunk_size = eps, chunk_size
    ctx.set_materialize_grads(False)  # unused final states get None: the backward skips them


def _backward_reference(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size, h, chunk_states):
    from .mlstm_backward import backward

    return backward(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps=eps, chunk_size=chunk_size)


def _backward_key(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size, h, chunk_states) -> tuple:
    return (q.device.type, q.dtype, q.shape, v.shape, C0 is not None, bool(chunk_states))


def _triton_backward(key, gh, gC, gn, gm, q, *args):
    if not runtime.kernels_can_run(q):
        return NotImplemented
    from ..codegen import triton_mlstm

    return triton_mlstm.backward(key, gh, gC, gn, gm, q, *args)


GRADIENTS_IN_INPUT_LAYOUT = True  # False: always contiguous (benchmarks/mlstm_layout_probe.py --gradients A/B)


def gradient_strides(t: Tensor) -> tuple[int, ...]:
    """The strides of the gradient xaccel::mlstm_backward returns for input t: t's own when t is
    a dense [B, H, S, D] with unit stride along D (the usual transposed projection, [B, S, H, D]
    seen as [B, H, S, D]: its gradient then flows back through the transpose and the reshape as
    a view, where a contiguous one costs a copy per input and layer), else contiguous. The fake
    and every path of the backward follow this one rule, so that they agree."""
    if GRADIENTS_IN_INPUT_LAYOUT and t.dim() == 4 and t.stride(-1) == 1 and _dense(t):
        return tuple(t.stride())
    strides, step = [], 1
    for d in reversed(t.shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _dense(t: Tensor) -> bool:
    """Whether t's elements fill one block of memory without gaps or overlaps, in any dim order."""
    step = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != step:
            return False
        step *= size
    return True


def gradient_like(t: Tensor) -> Tensor:
    """An empty gradient buffer for input t, in gradient_strides(t)."""
    return t.new_empty_strided(t.shape, gradient_strides(t))


def _in_gradient_layout(g: Tensor, t: Tensor) -> Tensor:
    """g as the fake promises it: the kernels write q, k, v's gradients in gradient_strides
    already; the reference's (and a copied input's) are copied into that layout."""
    if g.stride() == gradient_strides(t):
        return g
    out = gradient_like(t)
    out.copy_(g)
    return out


@torch.library.custom_op("xaccel::mlstm_backward", mutates_args=())
def mlstm_backward(gh: Tensor | None, gC: Tensor | None, gn: Tensor | None, gm: Tensor | None, q: Tensor, k: Tensor,
                   v: Tensor, i: Tensor, f: Tensor, C0: Tensor | None, n0: Tensor | None, m0: Tensor | None,
                   eps: float, chunk_size: int, h: Tensor | None, chunk_states: list[Tensor]) -> list[Tensor]:
    """xaccel::mlstm's backward as one opaque op, so that traced backward graphs hold a single
    node whose kernel is picked at run time: [dq, dk, dv, di, df] (+ [dC0, dn0, dm0] with a state).
    h: the forward's output, when saved (the kernels use it; the reference does not need it).
    chunk_states: [] or mlstm_with_chunk_states' kept states and row terms and its final state
    [Cs, ns, ms, rows, C, n, m] (the kernels skip their state scan and q k^T for the row terms
    when their chunk length is chunk_size)."""
    grads = runtime.dispatch("mlstm_backward", _backward_key, _backward_reference,
                             gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size, h, chunk_states)
    dqkv = [_in_gradient_layout(g, t) for g, t in zip(grads[:3], (q, k, v))]
    return dqkv + [g.contiguous() for g in grads[3:] if g is not None]


@mlstm_backward.register_fake
def _backward_fake(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size, h, chunk_states):
    # dq, dk, dv in gradient_strides (their input's layout when dense), the rest contiguous
    return [gradient_like(t) for t in (q, k, v)] + [t.new_empty(t.shape) for t in
                                                    (i, f, *((C0, n0, m0) if C0 is not None else ()))]


def _backward(ctx, gh, gC, gn, gm, *_kept_grads):
    saved = list(ctx.saved_tensors)
    kept, rest = saved[6:6 + ctx.n_kept], saved[6 + ctx.n_kept:]
    state = rest if ctx.has_state else [None, None, None]
    grads = torch.ops.xaccel.mlstm_backward(gh, gC, gn, gm, *saved[:5], *state, ctx.eps, ctx.chunk_size, saved[5],
                                            kept)
    return (*grads, *([None] * (8 - len(grads))), None, None)


runtime.register_provider("mlstm_backward", _triton_backward)


mlstm.register_autograd(_backward, setup_context=_setup_context)
mlstm_with_chunk_states.register_autograd(_backward, setup_context=_setup_context)
