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

xaccel::mlstm_saving is the same op that also returns the state entering every chunk of
chunk_size positions (in the kernels' layout) and each row's den[t] and m[t] at that chunking;
its backward reads them instead of rerunning the sequential state scan and q k^T. The lowering
uses it when the graph trains and the kernels' backward would read them
(lowering/mlstm/saving.py), at the cost of holding those states until the backward
(DQK/chunk_size x v's size; XACCEL_MLSTM_SAVING=0 declines).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

PAD_GATE = -1e30  # input gate of padded positions: exp(PAD_GATE - m) == 0 without creating inf - inf


def compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def forward(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C0: Tensor | None = None,
              n0: Tensor | None = None, m0: Tensor | None = None, eps: float = 1e-6,
              chunk_size: int = 64, save: bool = False) -> tuple[Tensor, ...]:
    """(h [B,H,S,DV] in q's dtype, C [B,H,DQK,DV], n [B,H,DQK], m [B,H]) — states in fp32/fp64;
    save (xaccel::mlstm_saving) adds the state entering each chunk: C [B,H,NC,DQK,DV] in q's dtype,
    n and m in fp32/fp64, and each row's (den[t], m[t]) [B,H,2,S] in fp32/fp64 (the kernels' layout;
    kept_shapes)."""
    B, H, S, DK = q.shape
    if S == 0:
        return _empty_sequence(q, v, C0, n0, m0, chunk_size, save)
    DV = v.shape[-1]
    out_dtype, cd = q.dtype, compute_dtype(q)
    L = chunk_size
    pad = (-S) % L
    q, k, v, i, logf = prepared(q, k, v, i, f, L)
    if C0 is None:
        C = q.new_zeros(B, H, DK, DV)
        n = q.new_zeros(B, H, DK)
        m = q.new_full((B, H), float("-inf"))
    else:
        C, n, m = C0.to(cd), n0.to(cd), m0.to(cd)
    hs, entering, rows = [], [], []
    for c in range(0, S + pad, L):
        if save:
            entering.append((C, n, m))
        sl = slice(c, c + L)
        h_c, C, n, m, den, m_t = chunk_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], i[:, :, sl], logf[:, :, sl],
                                            C, n, m, eps)
        hs.append(h_c)
        if save:
            rows.append(torch.stack((den, m_t), dim=2))                      # [B,H,2,L]
    h = torch.cat(hs, dim=2)[:, :, :S]
    if save:
        Cs, ns, ms = (torch.stack(t, dim=2) for t in zip(*entering))
        return h.to(out_dtype), C, n, m, Cs.to(out_dtype), ns, ms, torch.cat(rows, dim=3)[..., :S].contiguous()
    return h.to(out_dtype), C, n, m


def _empty_sequence(q: Tensor, v: Tensor, C0, n0, m0, chunk_size: int, save: bool) -> tuple[Tensor, ...]:
    """forward's results for S == 0: an empty h, the start state as the final state (copies: an op
    never returns its inputs; without one, C = n = 0 and m = -inf) and no chunks."""
    B, H, _, DK = q.shape
    cd = compute_dtype(q)
    if C0 is None:
        state = (q.new_zeros(B, H, DK, v.shape[-1], dtype=cd), q.new_zeros(B, H, DK, dtype=cd),
                 q.new_full((B, H), float("-inf"), dtype=cd))
    else:
        state = tuple(t.to(cd, copy=True) for t in (C0, n0, m0))
    kept = [q.new_empty(shape, dtype=dtype) for shape, dtype in kept_shapes(q, v, chunk_size)]
    return (q.new_empty(B, H, 0, v.shape[-1]), *state, *(kept if save else ()))


def prepared(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, chunk_size: int) -> tuple[Tensor, ...]:
    """The scan's inputs: (q, k / sqrt(DQK), v, i, logsigmoid(f)) in the compute dtype, the sequence
    padded to a multiple of chunk_size with positions that change nothing."""
    cd, DK, pad = compute_dtype(q), q.shape[-1], (-q.shape[-2]) % chunk_size
    q, k, v, i, f = (t.to(cd) for t in (q, k, v, i, f))
    k = k * DK ** -0.5
    logf = F.logsigmoid(f)
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        logf = F.pad(logf, (0, pad))
        i = F.pad(i, (0, pad), value=PAD_GATE)
    return q, k, v, i, logf


def chunk_step(qc: Tensor, kc: Tensor, vc: Tensor, ic: Tensor, logfc: Tensor, C: Tensor, n: Tensor, m: Tensor,
               eps: float) -> tuple[Tensor, ...]:
    """One chunk of the scan (k already scaled, logf = logsigmoid(f), compute dtype): the chunk's
    h from its positions in parallel plus the entering state, then the state leaving it.
    (h_c [B,H,L,DV], C, n, m, den [B,H,L], m_t [B,H,L]). Also the Scan body of the ONNX function."""
    L = qc.shape[-2]
    causal = torch.ones(L, L, dtype=torch.bool, device=qc.device).tril()
    b = logfc.cumsum(-1)                                                     # [B,H,L]
    logD = (b[..., :, None] - b[..., None, :] + ic[..., None, :]).masked_fill(~causal, float("-inf"))
    inter = b + m[..., None]                                                 # log weight of the state
    m_t = torch.maximum(inter, logD.amax(-1))                                # [B,H,L]
    w_inter = torch.exp(inter - m_t)
    Dm = torch.exp(logD - m_t[..., None])                                    # [B,H,L,L]
    Cqk = (qc @ kc.transpose(-1, -2)) * Dm
    num = w_inter[..., None] * (qc @ C) + Cqk @ vc
    den = w_inter * (qc @ n[..., None]).squeeze(-1) + Cqk.sum(-1)
    h_c = num / (torch.maximum(den.abs(), torch.exp(-m_t)) + eps)[..., None]
    g = b[..., -1]                                                           # whole-chunk log forget
    log_w = g[..., None] - b + ic                                            # [B,H,L]
    m_new = torch.maximum(g + m, log_w.amax(-1))
    decay, w = torch.exp(g + m - m_new), torch.exp(log_w - m_new[..., None])
    C = decay[..., None, None] * C + (kc * w[..., None]).transpose(-1, -2) @ vc
    n = decay[..., None] * n + (kc * w[..., None]).sum(-2)
    return h_c, C, n, m_new, den, m_t


def kept_shapes(q: Tensor, v: Tensor, chunk_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What xaccel::mlstm_saving keeps for the backward (its extra outputs), as shapes and dtypes:
    the states entering each chunk, C [B,H,NC,DQK,DV] in q's dtype (as the kernels store it),
    n [B,H,NC,DQK], m [B,H,NC], and each row's (den[t], m[t]) [B,H,2,S] under that chunking."""
    B, H, S, DK = q.shape
    NC, cd = -(-S // chunk_size), compute_dtype(q)
    return [((B, H, NC, DK, v.shape[-1]), q.dtype), ((B, H, NC, DK), cd), ((B, H, NC), cd), ((B, H, 2, S), cd)]


def parallel_oracle(q, k, v, i, f, C0=None, n0=None, m0=None, eps=1e-6):
    """The defining formula above, O(S^2) memory: a test oracle for the chunkwise reference."""
    cd = compute_dtype(q)
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



# ---- xaccel::mlstm_step ------------------------------------------------------------------------
# xaccel::mlstm_step — one recurrent mLSTM step for decoding, states in fp32.
#
#     m' = max(logsigmoid(f) + m, i);  f' = exp(logsigmoid(f) + m - m');  i' = exp(i - m')
#     C' = f' C + i' k v^T;  n' = f' n + i' k          (k scaled by 1/sqrt(DQK))
#     h  = (q^T C') / (max(|q^T n'|, exp(-m')) + eps)
#
# scale_q=True moves the 1/sqrt(DQK) from k to q: h is the same, but the states then hold unscaled
# k, the convention of the xlstm package's native step (its states are sqrt(DQK) times ours).
#
# Shapes: q, k [B,H,DQK]; v [B,H,DV]; i, f [B,H]; C [B,H,DQK,DV]; n [B,H,DQK]; m [B,H].
# A sequence of these steps from zero states (m = 0) equals xaccel::mlstm with initial state
# (0, 0, 0); see the module docstring.


def step(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C: Tensor, n: Tensor, m: Tensor,
              eps: float = 1e-6, scale_q: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """xaccel::mlstm_step (semantics in the comment above).
    (h [B,H,DV] in q's dtype, C', n', m') with the states in fp32 (float64 stays float64)."""
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = q.dtype
    q, k, v, i, f, C, n, m = (t.to(cd) for t in (q, k, v, i, f, C, n, m))
    if scale_q:
        q = q * q.shape[-1] ** -0.5
    else:
        k = k * q.shape[-1] ** -0.5
    logf = F.logsigmoid(f)
    m_new = torch.maximum(logf + m, i)
    fg, ig = torch.exp(logf + m - m_new), torch.exp(i - m_new)
    C = fg[..., None, None] * C + ig[..., None, None] * (k[..., :, None] * v[..., None, :])
    n = fg[..., None] * n + ig[..., None] * k
    num = (q[..., None, :] @ C).squeeze(-2)
    den = (q * n).sum(-1)
    h = num / (torch.maximum(den.abs(), torch.exp(-m_new)) + eps)[..., None]
    return h.to(out_dtype), C, n, m_new
