"""xaccel::slstm — the scalar-memory LSTM with exponential gating over a sequence.

Semantics, per batch row and head (R block-diagonal: one [4, D, D] block per head, R[h, g, j, k]
maps input unit k to gate g of unit j; b[g, h, j]):

    raw       = Wx_t + R h_{t-1} + b;         i, f, z, o = raw split by gate
    logfm     = m + logsigmoid(f)
    m'        = i                   where the state is fresh (see below)
              = max(i, logfm)       elsewhere
    i', f'    = exp(i - m'), exp(logfm - m')     (min(., 1) each with clamp_gates)
    c'        = f' c + i' tanh(z);   n' = f' n + i'       (n' = maximum(n', 1) with clamp_n)
    h'        = sigmoid(o) c' / n'

The libraries in the wild differ in three places, and the op takes them as arguments:
- fresh: "element" treats a row as fresh where its n == 0; "batch" treats every row as fresh when
  n == 0 everywhere in the batch (the xlstm package's vanilla loop: `if torch.all(n == 0.0)`).
  From a zero start both give m' = i at the first step; they differ for an initial state whose n
  is zero in some rows only.
- clamp_gates: min(exp(.), 1) on both exponential gates (the xlstm package).
- clamp_n: n' clamped at 1 from below (FlashRNN), as torch.maximum(n', 1): where n' is exactly 1
  (every fresh step from n = 0) the gradient splits in half, as in FlashRNN's own code.

h_{t-1} enters the recurrent product rounded to the input dtype (the output's dtype), as the
libraries store it; the state math (c, n, m, the gates) runs in fp32 (float64 stays float64).
Without an initial state, h = c = n = m = 0. Outputs: h for every step [B, T, NH, D] in the
input dtype, and the final (h, c, n, m) [B, NH, D] in the compute dtype.

This reference is the op's CPU path, the kernels' test oracle and the source of its ONNX body.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import checks
from ..checks import ANY

FRESH_RULES = ("element", "batch")


def compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check(Wx: Tensor, R: Tensor, b: Tensor, fresh: str, op: str = "slstm") -> None:
    """Shapes, dtypes and variant, with an error that names what is wrong (the op's contract):
    Wx [B, T, 4, NH, D] (a step's [B, 4, NH, D]), R [NH, 4, D, D], b [4, NH, D], all floating."""
    if fresh not in FRESH_RULES:
        checks.fail(op, f"fresh must be one of {FRESH_RULES}, got {fresh!r}")
    layout, lead = ("[B, 4, NH, D]", 1) if op == "slstm_step" else ("[B, T, 4, NH, D]", 2)
    checks.expect_shape(op, "Wx", Wx, layout, (ANY,) * lead + (4, ANY, ANY))
    NH, D = Wx.shape[-2:]
    checks.expect_shape(op, "R", R, "[NH, 4, D, D]", (NH, 4, D, D))
    checks.expect_shape(op, "b", b, "[4, NH, D]", (4, NH, D))
    checks.expect_floats(op, dict(Wx=Wx, R=R, b=b))


def zero_state(Wx: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    B, _, _, NH, D = Wx.shape
    z = Wx.new_zeros(B, NH, D, dtype=compute_dtype(Wx))
    return z, z, z, z


def step(Wx_t: Tensor, R: Tensor, b: Tensor, h: Tensor, c: Tensor, n: Tensor, m: Tensor,
         fresh: str = "element", clamp_gates: bool = False, clamp_n: bool = False
         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One step: Wx_t [B, 4, NH, D]; states [B, NH, D] -> (h', c', n', m') in the compute dtype.
    h enters the product rounded to Wx_t's dtype."""
    cd = compute_dtype(Wx_t)
    h_in = h.to(Wx_t.dtype).to(cd)
    raw = Wx_t.to(cd) + torch.einsum("bhk,hgjk->bghj", h_in, R.to(cd)) + b.to(cd)
    i, f, z, o = raw.unbind(1)
    c, n, m = c.to(cd), n.to(cd), m.to(cd)
    logfm = m + F.logsigmoid(f)
    is_fresh = (n == 0) if fresh == "element" else (n == 0).all()
    m_new = torch.where(is_fresh, i, torch.maximum(i, logfm))
    i_gate = torch.exp(i - m_new)
    f_gate = torch.exp(logfm - m_new)
    if clamp_gates:
        one = torch.ones_like(i_gate)
        i_gate, f_gate = torch.minimum(i_gate, one), torch.minimum(f_gate, one)
    c_new = f_gate * c + i_gate * torch.tanh(z)
    n_new = f_gate * n + i_gate
    if clamp_n:
        n_new = torch.maximum(n_new, torch.ones_like(n_new))
    h_new = torch.sigmoid(o) * c_new / n_new
    return h_new, c_new, n_new, m_new


def forward(Wx: Tensor, R: Tensor, b: Tensor, h0: Tensor | None, c0: Tensor | None, n0: Tensor | None,
            m0: Tensor | None, fresh: str = "element", clamp_gates: bool = False, clamp_n: bool = False
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Wx [B, T, 4, NH, D] -> (h [B, T, NH, D], h_T, c_T, n_T, m_T)."""
    check(Wx, R, b, fresh)
    h, c, n, m = zero_state(Wx) if h0 is None else (h0, c0, n0, m0)
    cd = compute_dtype(Wx)
    h, c, n, m = (s.to(cd) for s in (h, c, n, m))
    outs = []
    for t in range(Wx.shape[1]):
        h, c, n, m = step(Wx[:, t], R, b, h, c, n, m, fresh, clamp_gates, clamp_n)
        outs.append(h.to(Wx.dtype))
    B, T, _, NH, D = Wx.shape
    if not outs:  # T == 0: the start state is the final one, as copies (an op never returns its inputs)
        return Wx.new_empty(B, 0, NH, D), *(s.clone() for s in (h, c, n, m))
    return torch.stack(outs, 1), h, c, n, m
