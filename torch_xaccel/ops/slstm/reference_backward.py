"""The analytic backward of xaccel::slstm in plain torch: the op's backward on the CPU and the
spec the backward kernels implement.

It runs the forward again keeping each step's intermediates, then walks back in time. It follows
autograd's rules for the reference's expressions exactly, including their ties: torch.minimum
and torch.maximum give half the gradient to each side where both are equal (min(exp(0), 1) at
every fresh step), and torch.maximum(n', 1) where n' is exactly 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import reference
from .reference import check, compute_dtype, zero_state


def _share(a: Tensor, b: Tensor) -> Tensor:
    """d max(a, b) / da as autograd takes it: 1 where a > b, 1/2 where equal, 0 elsewhere."""
    return (a > b).to(a.dtype) + 0.5 * (a == b).to(a.dtype)


def _forward_keeping(Wx, R, b, h, c, n, m, fresh, clamp_gates, clamp_n):
    cd = compute_dtype(Wx)
    Rc, bc = R.to(cd), b.to(cd)
    steps = []
    for t in range(Wx.shape[1]):
        h_in = h.to(Wx.dtype).to(cd)
        raw = Wx[:, t].to(cd) + torch.einsum("bhk,hgjk->bghj", h_in, Rc) + bc
        i, f, z, o = raw.unbind(1)
        logfm = m + F.logsigmoid(f)
        is_fresh = (n == 0) if fresh == "element" else (n == 0).all().expand_as(n)
        m_new = torch.where(is_fresh, i, torch.maximum(i, logfm))
        ei, ef = torch.exp(i - m_new), torch.exp(logfm - m_new)
        ig, fg = (torch.clamp(ei, max=1.0), torch.clamp(ef, max=1.0)) if clamp_gates else (ei, ef)
        tz, so = torch.tanh(z), torch.sigmoid(o)
        c_new = fg * c + ig * tz
        n_raw = fg * n + ig
        n_new = torch.maximum(n_raw, torch.ones_like(n_raw)) if clamp_n else n_raw
        h_new = so * c_new / n_new
        steps.append((h_in, i, f, logfm, is_fresh, m_new, ei, ef, ig, fg, tz, so, c, n, c_new, n_raw, n_new))
        h, c, n, m = h_new, c_new, n_new, m_new
    return steps


def kept_states(Wx: Tensor, R: Tensor, b: Tensor, h0, c0, n0, m0, fresh: str = "element",
                clamp_gates: bool = False, clamp_n: bool = False) -> tuple[Tensor, Tensor]:
    """What xaccel::slstm_saving keeps (op.kept_shapes): every step's pre-activations
    [B, T, 4, NH, D] and state after the step [3, B, T, NH, D] (c, n, m)."""
    check(Wx, R, b, fresh)
    cd = compute_dtype(Wx)
    h, c, n, m = zero_state(Wx) if h0 is None else (s.to(cd) for s in (h0, c0, n0, m0))
    raws, states = [], []
    Rc, bc = R.to(cd), b.to(cd)
    for t in range(Wx.shape[1]):
        h_in = h.to(Wx.dtype).to(cd)
        raws.append(Wx[:, t].to(cd) + torch.einsum("bhk,hgjk->bghj", h_in, Rc) + bc)
        h, c, n, m = reference.step(Wx[:, t], R, b, h, c, n, m, fresh, clamp_gates, clamp_n)
        states.append(torch.stack((c, n, m)))
    B, T, _, NH, D = Wx.shape
    if not raws:
        return Wx.new_empty(B, 0, 4, NH, D, dtype=cd), Wx.new_empty(3, B, 0, NH, D, dtype=cd)
    return torch.stack(raws, 1), torch.stack(states, 2)


def backward(gy, ghT, gcT, gnT, gmT, Wx: Tensor, R: Tensor, b: Tensor, h0, c0, n0, m0, fresh: str = "element",
             clamp_gates: bool = False, clamp_n: bool = False) -> list[Tensor]:
    """[dWx, dR, db] (+ [dh0, dc0, dn0, dm0] with an initial state); None output gradients are zeros."""
    check(Wx, R, b, fresh)
    cd = compute_dtype(Wx)
    has_state = h0 is not None
    h, c, n, m = zero_state(Wx) if not has_state else (s.to(cd) for s in (h0, c0, n0, m0))
    steps = _forward_keeping(Wx, R, b, h, c, n, m, fresh, clamp_gates, clamp_n)
    B, T, _, NH, D = Wx.shape
    zeros = Wx.new_zeros(B, NH, D, dtype=cd)
    gh, gc, gn, gm = (zeros if g is None else g.to(cd) for g in (ghT, gcT, gnT, gmT))
    Rc = R.to(cd)
    dWx = Wx.new_zeros(Wx.shape, dtype=cd)
    dR = torch.zeros_like(Rc)
    for t in reversed(range(T)):
        h_in, i, f, logfm, is_fresh, m_new, ei, ef, ig, fg, tz, so, c, n, c_new, n_raw, n_new = steps[t]
        if gy is not None:
            gh = gh + gy[:, t].to(cd)
        # h' = (so * c') / n'
        gp = gh / n_new
        gn_new = gn - gh * (so * c_new) / (n_new * n_new)
        gso = gp * c_new
        gc_new = gc + gp * so
        gn_raw = gn_new * _share(n_raw, torch.ones_like(n_raw)) if clamp_n else gn_new
        gfg = gn_raw * n + gc_new * c
        gig = gn_raw + gc_new * tz
        gc, gn = gc_new * fg, gn_raw * fg
        gz = gc_new * ig * (1 - tz * tz)
        go = gso * so * (1 - so)
        one = torch.ones_like(ei)
        gei = gig * _share(one, ei) if clamp_gates else gig  # d min(x, 1) / dx = [1 > x] + [1 == x] / 2
        gef = gfg * _share(one, ef) if clamp_gates else gfg
        gm_new = gm - gei * ei - gef * ef
        gi = gei * ei
        glogfm = gef * ef
        gmax = torch.where(is_fresh, torch.zeros_like(gm_new), gm_new)
        gi = gi + torch.where(is_fresh, gm_new, torch.zeros_like(gm_new)) + gmax * _share(i, logfm)
        glogfm = glogfm + gmax * _share(logfm, i)
        gm = glogfm
        gf = glogfm * torch.sigmoid(-f)
        graw = torch.stack((gi, gf, gz, go), 1)  # [B, 4, NH, D]
        dWx[:, t] = graw
        dR += torch.einsum("bghj,bhk->hgjk", graw, h_in)
        gh = torch.einsum("bghj,hgjk->bhk", graw, Rc)
    db = dWx.sum((0, 1))
    grads = [dWx.to(Wx.dtype), dR.to(R.dtype), db.to(b.dtype)]
    if has_state:  # (copies where T == 0: the final state's gradients would be returned as they came)
        grads += [g.to(s.dtype, copy=T == 0) for g, s in zip((gh, gc, gn, gm), (h0, c0, n0, m0))]
    return grads
