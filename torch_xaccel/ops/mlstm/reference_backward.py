"""Analytic backward of xaccel::mlstm, chunk by chunk in plain torch: the blueprint of the backward
kernels, and the op's backward wherever they do not run.

All stabilizers cancel in exact arithmetic except through eps: with unstabilized NUM, DEN,
    h_t = NUM_t / (max(|DEN_t|, 1) + eps * exp(m_t)).
So the gradient is (a) the gradient with every stabilizer held fixed, plus (b) the eps term
dm_t = -(dh_t . h_t) * eps / N_t routed to the argmax that defines m_t (and the final-state m's
own gradient routed the same way). (a) is gated linear attention with v augmented by a column of
ones (the normalizer). The state gradient is carried stabilized: the true-state gradient times
exp(m) of the state it belongs to. True states are ~exp(m) and their gradients ~exp(-m), so in fp32
the true-state gradient underflows from |m| ~ 88 while the factors meeting it (exp(g - b + i))
overflow: inf * 0 = NaN gradients for input gates near +-88 and beyond. Stabilized, every factor
is exp of a difference bounded by the forward's stabilizers (<= 1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import PAD_GATE, compute_dtype


def route_max_grads(dm: Tensor, i: Tensor, Fc: Tensor, m0: Tensor | None):
    """Gradient of m_t = Fc_t + max(m0, max_{s<=t} (i_s - Fc_s)) for upstream dm [B,H,S] (the
    Fc_t term is added by the caller): (di, dlogf, dm0). Ties go to one argmax."""
    B, H, S = i.shape
    vals = i - Fc
    if m0 is not None:
        vals = torch.cat([m0[..., None], vals], -1)  # position 0 = the initial state
    else:
        vals = torch.cat([vals.new_full((B, H, 1), float("-inf")), vals], -1)
    arg = torch.cummax(vals, -1).indices[..., 1:]              # [B,H,S] in 0..S (0 = m0)
    di_ext = torch.zeros(B, H, S + 1, dtype=dm.dtype, device=dm.device).scatter_add_(-1, arg, dm)
    # m_t - Fc_t depends on -Fc_{s*}: Fc_t - Fc_{s*} = sum of logf over (s*, t]
    diff = torch.zeros(B, H, S + 2, dtype=dm.dtype, device=dm.device)
    diff.scatter_add_(-1, arg + 1, dm)                         # starts after s* (1-based logf index s*+1)
    t1 = torch.arange(1, S + 1, device=dm.device).expand(B, H, S) + 1
    diff.scatter_add_(-1, t1, -dm)
    dlogf = diff.cumsum(-1)[..., 1:S + 1]
    return di_ext[..., 1:], dlogf, (di_ext[..., 0] if m0 is not None else None)


def _empty_sequence_grads(dC_out, dn_out, dm_out, q, k, v, i, f, C0, n0, m0) -> list:
    """backward for S == 0, where the final state is the start state: empty input gradients, the
    final state's gradients as the start state's (copies, in its dtypes; zeros where None)."""
    grads = [torch.zeros_like(t) for t in (q, k, v, i, f)]
    if C0 is None:
        return grads + [None, None, None]
    return grads + [torch.zeros_like(s) if g is None else g.to(s.dtype, copy=True)
                    for g, s in zip((dC_out, dn_out, dm_out), (C0, n0, m0))]


def backward(dh, dC_out, dn_out, dm_out, q, k, v, i, f, C0=None, n0=None, m0=None, eps=1e-6, chunk_size=64):
    """Gradients (dq, dk, dv, di, df, dC0, dn0, dm0) of xaccel::mlstm given the output gradients
    (any of which may be None)."""
    B, H, S, DK = q.shape
    if S == 0:
        return _empty_sequence_grads(dC_out, dn_out, dm_out, q, k, v, i, f, C0, n0, m0)
    DV = v.shape[-1]
    cd = compute_dtype(q)
    L = chunk_size
    pad = (-S) % L
    dtypes = [t.dtype for t in (q, k, v, i, f)]
    scale = DK ** -0.5
    q, k, v, i, f = (t.to(cd) for t in (q, k, v, i, f))
    ks = k * scale
    logf = F.logsigmoid(f)
    Fc_full = logf.cumsum(-1)
    dh = torch.zeros_like(v) if dh is None else dh.to(cd)
    if pad:
        q, ks, v, dh = (F.pad(t, (0, 0, 0, pad)) for t in (q, ks, v, dh))
        logf_p = F.pad(logf, (0, pad))
        i_p = F.pad(i, (0, pad), value=PAD_GATE)
    else:
        logf_p, i_p = logf, i
    has_state = C0 is not None
    if has_state:
        C, n, m = C0.to(cd), n0.to(cd), m0.to(cd)
    else:
        C, n, m = q.new_zeros(B, H, DK, DV), q.new_zeros(B, H, DK), q.new_full((B, H), float("-inf"))
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    # forward sweep: keep each chunk's entering state and the per-position m_t, N_t, den_t, h_t
    states, per_pos = [], []
    for c in range(0, S + pad, L):
        qc, kc, vc, ic = q[:, :, c:c + L], ks[:, :, c:c + L], v[:, :, c:c + L], i_p[:, :, c:c + L]
        b = logf_p[:, :, c:c + L].cumsum(-1)
        logD = (b[..., :, None] - b[..., None, :] + ic[..., None, :]).masked_fill(~causal, float("-inf"))
        m_t = torch.maximum(b + m[..., None], logD.amax(-1))
        w = torch.exp(b + m[..., None] - m_t)
        A = torch.exp(logD - m_t[..., None])
        QK = qc @ kc.transpose(-1, -2)
        num = w[..., None] * (qc @ C) + (QK * A) @ vc
        den = w * (qc @ n[..., None]).squeeze(-1) + (QK * A).sum(-1)
        floor = torch.exp(-m_t)
        N = torch.maximum(den.abs(), floor) + eps
        states.append((C, n, m))
        per_pos.append((b, logD, m_t, w, A, QK, num, den, floor, N))
        g = b[..., -1]
        log_u = g[..., None] - b + ic
        m_new = torch.maximum(g + m, log_u.amax(-1))
        decay, u = torch.exp(g + m - m_new), torch.exp(log_u - m_new[..., None])
        C = decay[..., None, None] * C + (kc * u[..., None]).transpose(-1, -2) @ vc
        n = decay[..., None] * n + (kc * u[..., None]).sum(-2)
        m = m_new
    C_T, n_T, m_T = C, n, m
    # the final-state outputs' gradient: already stabilized (the outputs are C_T, n_T, stabilized by m_T)
    dC = dC_out.to(cd) if dC_out is not None else torch.zeros_like(C_T)
    dn = dn_out.to(cd) if dn_out is not None else torch.zeros_like(n_T)
    m_end = m_T  # the stabilizer of the state dC, dn belong to: the one leaving the chunk below
    dmT = (dm_out.to(cd) if dm_out is not None else torch.zeros_like(m_T))
    if dC_out is not None:
        dmT = dmT - (dC_out.to(cd) * C_T).sum((-1, -2))
    if dn_out is not None:
        dmT = dmT - (dn_out.to(cd) * n_T).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(ks), torch.zeros_like(v)
    di, dlogf = torch.zeros_like(i_p), torch.zeros_like(logf_p)
    dm_pos = torch.zeros_like(i_p)  # eps-term gradient of each m_t, routed after the sweep
    for idx in range(len(states) - 1, -1, -1):
        c = idx * L
        C, n, m = states[idx]
        b, logD, m_t, w, A, QK, num, den, floor, N = per_pos[idx]
        qc, kc, vc, ic, dhc = (q[:, :, c:c + L], ks[:, :, c:c + L], v[:, :, c:c + L], i_p[:, :, c:c + L],
                               dh[:, :, c:c + L])
        h = num / N[..., None]
        hdh = (h * dhc).sum(-1)
        dnum = dhc / N[..., None]
        dden = -(hdh / N) * torch.sign(den) * (den.abs() >= floor).to(cd)
        dm_pos[:, :, c:c + L] = -hdh * eps / N
        # intra-chunk (stabilizers fixed)
        G = dnum @ vc.transpose(-1, -2) + dden[..., None]          # d(num')/d(QK*A) per (t, s)
        dS = G * A
        dlogD = G * QK * A
        dq_c = dS @ kc + w[..., None] * (dnum @ C.transpose(-1, -2) + dden[..., None] * n[..., None, :])
        dk_c = dS.transpose(-1, -2) @ qc
        dv_c = (QK * A).transpose(-1, -2) @ dnum
        dlogw = w * ((dnum * (qc @ C)).sum(-1) + dden * (qc @ n[..., None]).squeeze(-1))
        db = dlogD.sum(-1) - dlogD.sum(-2) + dlogw
        di_c = dlogD.sum(-2)
        # this chunk's writes into the next state: C_true' = e^g C_true + sum_s e^{g - b_s + i_s} k_s v_s^T,
        # met by the stabilized gradient of that state (u <= 1: m_end >= g - b_s + i_s)
        g = b[..., -1]
        u = torch.exp(g[..., None] - b + ic - m_end[..., None])
        kdC = kc @ dC                                               # [L, DV]
        dk_c = dk_c + u[..., None] * (vc @ dC.transpose(-1, -2) + dn[..., None, :])
        dv_c = dv_c + u[..., None] * kdC
        dlogu = u * ((kdC * vc).sum(-1) + (kc * dn[..., None, :]).sum(-1))
        di_c = di_c + dlogu
        db = db - dlogu
        carry = torch.exp(g + m - m_end)                            # e^g from state to state, rescaled: <= 1
        dg = dlogu.sum(-1) + carry * ((dC * C).sum((-1, -2)) + (dn * n).sum(-1))
        # the stabilized gradient of the state entering this chunk: the carry and this chunk's reads
        # (r = e^{b - m_t} rescaled by e^{m}: <= 1). Without an initial state the first chunk's m is
        # -inf: its entering gradient comes out 0 and is not used.
        r = torch.exp(b - m_t + m[..., None])
        dC = carry[..., None, None] * dC + (qc * r[..., None]).transpose(-1, -2) @ dnum
        dn = carry[..., None] * dn + ((qc * r[..., None]) * dden[..., None]).sum(-2)
        m_end = m
        dlogf[:, :, c:c + L] = db.flip(-1).cumsum(-1).flip(-1) + dg[..., None]
        dq[:, :, c:c + L], dk[:, :, c:c + L], dv[:, :, c:c + L], di[:, :, c:c + L] = dq_c, dk_c, dv_c, di_c
    dq, dk, dv, di, dlogf, dm_pos = (t[:, :, :S] for t in (dq, dk, dv, di, dlogf, dm_pos))
    # eps term of every h_t and the final m_T: route through the max that defines them
    dm_pos[..., -1] += dmT
    r_di, r_dlogf, r_dm0 = route_max_grads(dm_pos, i, Fc_full, m0.to(cd) if has_state else None)
    di = di + r_di
    # m_t also carries +Fc_t (+ sum of logf up to t): every logf_r, r <= t, gets dm_t
    dlogf = dlogf + r_dlogf
    df = dlogf * torch.sigmoid(-f)
    grads = [dq.to(dtypes[0]), (dk * scale).to(dtypes[1]), dv.to(dtypes[2]), di.to(dtypes[3]), df.to(dtypes[4])]
    if has_state:  # dC, dn: stabilized by m0, the inputs' own convention
        dC0, dn0 = dC, dn
        dm0 = (dC * C0.to(cd)).sum((-1, -2)) + (dn * n0.to(cd)).sum(-1) + r_dm0
        grads += [dC0.to(C0.dtype), dn0.to(n0.dtype), dm0.to(m0.dtype)]
    else:
        grads += [None, None, None]
    return grads
