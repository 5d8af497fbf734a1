"""The sweep's model forms, written from the equations (not from the package's demo or tests), each
in its own style, and the size grid the runner walks.

Every form is an nn.Module of pre-norm residual blocks (x + mixer(norm(x)), then x + SwiGLU(norm(x)))
taking embeddings x [B, S, d] and returning [B, S, d]; the LM form (hf_xlstm) takes ids [B, S] and
returns logits. `build(row)` makes the model (seeded) and its inputs for one row.

dtypes: "bf16" (weights and the recurrence in bf16), "bf16/fp32rec" (bf16 weights, the mLSTM
recurrence computed in fp32: q, k, v and the gates cast inside the mixer, h cast back), "fp32".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "bf16/fp32rec": torch.bfloat16, "fp32": torch.float32}


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for 16-bit tensors, else the tensor's own (an fp64 reference stays fp64)."""
    return torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype


def mlp_hidden(d: int) -> int:
    """SwiGLU hidden width: 8/3 d rounded to a multiple of 64."""
    return max(64, int(round(8 * d / 3 / 64)) * 64)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.to(_compute_dtype(x))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        h = mlp_hidden(d)
        self.w_gate = nn.Linear(d, h, bias=False)
        self.w_up = nn.Linear(d, h, bias=False)
        self.w_down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class PreNormBlock(nn.Module):
    """x + mixer(norm(x)); then x + SwiGLU(norm(x))."""

    def __init__(self, d: int, mixer: nn.Module, norm: Callable[[int], nn.Module] = nn.LayerNorm):
        super().__init__()
        self.norm1, self.mixer, self.norm2, self.mlp = norm(d), mixer, norm(d), SwiGLU(d)

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def _forget_bias(linear: nn.Linear) -> None:
    """Forget gates start open (bias 3 .. 6, as the xLSTM paper's models): long memories."""
    with torch.no_grad():
        linear.bias.copy_(torch.linspace(3.0, 6.0, linear.bias.numel()))


# --- 1. mlstm_paper: the stabilized parallel form as the xLSTM paper writes it -----------------------

class MLSTMPaper(nn.Module):
    def __init__(self, d: int, nh: int, fp32_rec: bool):
        super().__init__()
        self.nh, self.dh, self.fp32_rec = nh, d // nh, fp32_rec
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.wi, self.wf = nn.Linear(d, nh), nn.Linear(d, nh)
        self.wo = nn.Linear(d, d, bias=False)
        _forget_bias(self.wf)

    def forward(self, x):
        B, S, d = x.shape
        q = self.wq(x).view(B, S, self.nh, self.dh).transpose(1, 2)  # [B, NH, S, DH]
        k = self.wk(x).view(B, S, self.nh, self.dh).transpose(1, 2)
        v = self.wv(x).view(B, S, self.nh, self.dh).transpose(1, 2)
        i = self.wi(x).transpose(1, 2)  # [B, NH, S]
        f = self.wf(x).transpose(1, 2)
        if self.fp32_rec:
            ct = _compute_dtype(x)
            q, k, v, i, f = (t.to(ct) for t in (q, k, v, i, f))
        logf = F.logsigmoid(f)
        Fc = torch.cumsum(logf, dim=-1)
        logD = Fc[..., :, None] - Fc[..., None, :] + i[..., None, :]
        mask = torch.tril(torch.ones(S, S, dtype=torch.bool, device=x.device))
        logD = torch.where(mask, logD, float("-inf"))
        m = torch.max(logD, dim=-1, keepdim=True).values
        D = torch.exp(logD - m)
        C = (q @ k.transpose(-2, -1) / math.sqrt(self.dh)) * D
        n = torch.maximum(C.sum(dim=-1, keepdim=True).abs(), torch.exp(-m))
        h = (C / (n + 1e-6)) @ v
        return self.wo(h.transpose(1, 2).reshape(B, S, d).to(x.dtype))


# --- 2. mlstm_einsum: the same math in einsum spellings, [B, S, NH, DH] layout ------------------------

class MLSTMEinsum(nn.Module):
    def __init__(self, d: int, nh: int, fp32_rec: bool):
        super().__init__()
        self.nh, self.dh, self.fp32_rec = nh, d // nh, fp32_rec
        self.w_qkv = nn.Parameter(torch.randn(3, nh, d // nh, d) / math.sqrt(d))
        self.w_gates = nn.Parameter(torch.randn(2, nh, d) / math.sqrt(d))  # input, forget
        self.b_gates = nn.Parameter(torch.stack([torch.zeros(nh), torch.linspace(3.0, 6.0, nh)]))
        self.w_out = nn.Parameter(torch.randn(d, nh, d // nh) / math.sqrt(d))

    def forward(self, x):
        q, k, v = torch.einsum("bsd,ched->cbshe", x, self.w_qkv).unbind(0)  # each [B, S, NH, DH]
        ig, fg = (torch.einsum("bsd,chd->cbhs", x, self.w_gates) + self.b_gates[:, None, :, None]).unbind(0)
        if self.fp32_rec:
            ct = _compute_dtype(x)
            q, k, v, ig, fg = (t.to(ct) for t in (q, k, v, ig, fg))
        S = x.shape[1]
        q = q * self.dh ** -0.5
        cum = F.logsigmoid(fg).cumsum(-1)  # [B, NH, S]
        logD = cum.unsqueeze(-1) - cum.unsqueeze(-2) + ig.unsqueeze(-2)  # [B, NH, S(t), S(s)]
        causal = torch.tril(torch.ones(S, S, dtype=torch.bool, device=x.device))
        logD = logD.masked_fill(~causal, float("-inf"))
        m = logD.amax(-1, keepdim=True)
        C = torch.einsum("bshe,bthe->bhst", q, k) * torch.exp(logD - m)
        n = torch.maximum(C.sum(-1, keepdim=True).abs(), torch.exp(-m))
        h = torch.einsum("bhst,bthe->bshe", C / (n + 1e-6), v)
        return torch.einsum("bshe,dhe->bsd", h.to(x.dtype), self.w_out)


# --- 3. mlstm_chunkwise: chunks of L in parallel, a recurrent state between them ---------------------

def mlstm_chunkwise(q, k, v, i, f, L: int = 64, eps: float = 1e-6):
    """h [B, NH, S, DH] of the mLSTM from q, k, v [B, NH, S, DH], gate pre-activations i, f [B, NH, S].

    The recurrence: C_t = f_t C_{t-1} + i_t v_t k_t^T, n_t = f_t n_{t-1} + i_t k_t with
    f_t = sigmoid(f~_t), i_t = exp(i~_t), and h_t = C_t q_t / max(|n_t^T q_t|, 1), q scaled by
    1/sqrt(DH). Stabilized by m_t = max(log f_t + m_{t-1}, i~_t) (m_0 = -inf): the state is kept as
    exp(-m_t) C_t, exp(-m_t) n_t, and h_t = (C~_t q_t) / (max(|n~_t^T q_t|, exp(-m_t)) + eps), the
    parallel form's normalizer exactly (there m_t is the row max of logD, which unrolls to the same
    running max).

    Per chunk, with b the within-chunk cumulative log forget gates (inclusive):
      inter (the state entering the chunk): log weight b_t + m_prev
      intra (positions s <= t of the chunk): log weight b_t - b_s + i~_s
      m_t = max(b_t + m_prev, max_s (b_t - b_s + i~_s))
    and at the chunk's end the state moves on with the same weights at t = L - 1.
    """
    B, NH, S, DH = q.shape
    q = q * DH ** -0.5
    C = q.new_zeros(B, NH, DH, DH)  # [value dim, key dim]: C q is a matrix-vector product
    n = q.new_zeros(B, NH, DH)
    m = q.new_full((B, NH), float("-inf"))
    logf = F.logsigmoid(f)
    hs = []
    for c0 in range(0, S, L):
        qc, kc, vc = q[:, :, c0:c0 + L], k[:, :, c0:c0 + L], v[:, :, c0:c0 + L]
        ic, b = i[:, :, c0:c0 + L], logf[:, :, c0:c0 + L].cumsum(-1)  # [B, NH, l]
        ln = qc.shape[2]
        tri = torch.ones(ln, ln, dtype=torch.bool, device=q.device).tril()
        intra = (b[..., :, None] - b[..., None, :] + ic[..., None, :]).masked_fill(~tri, float("-inf"))
        inter = b + m[..., None]  # [B, NH, l]
        m_t = torch.maximum(inter, intra.amax(-1))
        w_inter = torch.exp(inter - m_t)  # [B, NH, l]
        W = torch.exp(intra - m_t[..., None])  # [B, NH, l, l]
        scores = (qc @ kc.transpose(-1, -2)) * W
        num = w_inter[..., None] * (qc @ C.transpose(-1, -2)) + scores @ vc
        den = w_inter * (qc * n[:, :, None, :]).sum(-1) + scores.sum(-1)
        hs.append(num / (torch.maximum(den.abs(), torch.exp(-m_t)) + eps)[..., None])
        # the state at the chunk's last position
        m_new = m_t[..., -1]
        decay = torch.exp(inter[..., -1] - m_new)  # b_L + m_prev - m_new
        w_s = torch.exp(b[..., -1:] - b + ic - m_new[..., None])  # [B, NH, l]
        C = decay[..., None, None] * C + (vc * w_s[..., None]).transpose(-1, -2) @ kc
        n = decay[..., None] * n + (kc * w_s[..., None]).sum(-2)
        m = m_new
    return torch.cat(hs, dim=2)


class MLSTMChunkwise(nn.Module):
    def __init__(self, d: int, nh: int, fp32_rec: bool, chunk: int = 64):
        super().__init__()
        self.nh, self.dh, self.fp32_rec, self.chunk = nh, d // nh, fp32_rec, chunk
        self.proj = nn.Linear(d, 3 * d + 2 * nh)  # q, k, v, then the input and forget gates
        self.out = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.proj.bias.zero_()
            self.proj.bias[-nh:] = torch.linspace(3.0, 6.0, nh)

    def forward(self, x):
        B, S, d = x.shape
        y = self.proj(x)
        q, k, v = (t.reshape(B, S, self.nh, self.dh).permute(0, 2, 1, 3) for t in y[..., :3 * d].split(d, -1))
        i, f = y[..., 3 * d:].reshape(B, S, 2, self.nh).permute(2, 0, 3, 1).unbind(0)
        if self.fp32_rec:
            ct = _compute_dtype(x)
            q, k, v, i, f = (t.to(ct) for t in (q, k, v, i, f))
        h = mlstm_chunkwise(q, k, v, i, f, self.chunk)
        return self.out(h.permute(0, 2, 1, 3).reshape(B, S, d).to(x.dtype))


# --- 4. slstm_loop: the sLSTM, a Python loop over time steps -----------------------------------------

class SLSTMLoop(nn.Module):
    """Gates z, i, f, o from input projections plus per-head block-diagonal recurrent weights
    R [4, NH, DH, DH]; exponential input gate, sigmoid forget gate in log space,
    m_t = max(logsigmoid(f~_t) + m_{t-1}, i~_t), c and n stabilized by m, h = o * c / n. The state is
    fp32 (fp64 in an fp64 reference)."""

    def __init__(self, d: int, nh: int):
        super().__init__()
        self.nh, self.dh = nh, d // nh
        self.wz, self.wi, self.wf, self.wo = (nn.Linear(d, d) for _ in range(4))
        self.R = nn.Parameter(torch.randn(4, nh, d // nh, d // nh) / math.sqrt(d // nh))
        self.out = nn.Linear(d, d, bias=False)
        _forget_bias(self.wf)

    def forward(self, x):
        B, S, d = x.shape
        st = _compute_dtype(x)
        pre = [w(x).to(st).view(B, S, self.nh, self.dh) for w in (self.wz, self.wi, self.wf, self.wo)]
        R = self.R.to(st)
        h = x.new_zeros(B, self.nh, self.dh, dtype=st)
        c, n, m = torch.zeros_like(h), torch.zeros_like(h), torch.zeros_like(h)
        out = []
        for t in range(S):
            rz, ri, rf, ro = (torch.einsum("bhe,hef->bhf", h, R[g]) for g in range(4))
            zt, it, ft, ot = pre[0][:, t] + rz, pre[1][:, t] + ri, pre[2][:, t] + rf, pre[3][:, t] + ro
            logf = F.logsigmoid(ft)
            m_new = torch.maximum(logf + m, it)
            i_g = torch.exp(it - m_new)
            f_g = torch.exp(logf + m - m_new)
            c = f_g * c + i_g * torch.tanh(zt)
            n = f_g * n + i_g
            h = torch.sigmoid(ot) * c / n
            m = m_new
            out.append(h)
        return self.out(torch.stack(out, 1).reshape(B, S, d).to(x.dtype))


# --- 5. swiglu_mlp and 6. gemm_chain on token rows [M, d] ---------------------------------------------

class MLPStack(nn.Module):
    """Two pre-norm SwiGLU blocks on x [M, d]."""

    def __init__(self, d: int, blocks: int = 2):
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(d) for _ in range(blocks))
        self.mlps = nn.ModuleList(SwiGLU(d) for _ in range(blocks))

    def forward(self, x):
        for norm, mlp in zip(self.norms, self.mlps):
            x = x + mlp(norm(x))
        return x


class GemmChain(nn.Module):
    """gelu(x @ W1 + b1) @ W2 + b2 + x, twice (hidden 4d), written with @ and +."""

    def __init__(self, d: int, layers: int = 2):
        super().__init__()
        h = 4 * d
        self.W1 = nn.ParameterList(nn.Parameter(torch.randn(d, h) / math.sqrt(d)) for _ in range(layers))
        self.b1 = nn.ParameterList(nn.Parameter(torch.randn(h) * 0.1) for _ in range(layers))
        self.W2 = nn.ParameterList(nn.Parameter(torch.randn(h, d) / math.sqrt(h)) for _ in range(layers))
        self.b2 = nn.ParameterList(nn.Parameter(torch.randn(d) * 0.1) for _ in range(layers))

    def forward(self, x):
        for W1, b1, W2, b2 in zip(self.W1, self.b1, self.W2, self.b2):
            x = F.gelu(x @ W1 + b1) @ W2 + b2 + x
        return x


# --- 7. hf_xlstm and 8. xlstm_stack: the libraries' own models ----------------------------------------

def hf_unavailable() -> str:
    try:
        import transformers  # noqa: F401
        from transformers.models.xlstm import modeling_xlstm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: skip the row
        return f"transformers' xLSTMForCausalLM not importable ({type(e).__name__}: {str(e)[:120]})"
    return ""


class HFCausalLM(nn.Module):
    """transformers' xLSTMForCausalLM (its in-file kernels, the xlstm package hidden, as
    torch_xaccel.bench's model suite runs it) returning logits. Inference runs with use_cache=True,
    as generate() does (transformers' bf16 inference path fails without a cache)."""

    def __init__(self, size: dict, mode: str):
        super().__init__()
        from torch_xaccel.bench.model import transformers_xlstm_without_package

        modeling = transformers_xlstm_without_package()
        cfg = modeling.xLSTMConfig(vocab_size=size["vocab"], chunk_size=size.get("L", 64),
                                   mode="train" if mode == "train" else "inference", use_cache=False,
                                   hidden_size=size["d"], num_heads=size["nh"], num_blocks=size["blocks"])
        self.lm = modeling.xLSTMForCausalLM(cfg)

    def forward(self, ids):
        if self.training:
            return self.lm(ids).logits
        return self.lm(ids, use_cache=True).logits


def xlstm_unavailable() -> str:
    try:
        import xlstm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"xlstm package not importable ({type(e).__name__}: {str(e)[:120]})"
    return ""


def xlstm_block_stack(size: dict) -> nn.Module:
    """The xlstm package's xLSTMBlockStack as torch_xaccel.bench builds it (sLSTM blocks on the
    pure-PyTorch vanilla backend, random recurrent weights), on any device."""
    from torch_xaccel.bench.model import xlstm_block_stack as build

    return build(size["d"], size["blocks"], size.get("slstm_at", []), "vanilla", size["B"], size["S"], size["nh"])


# --- 9. mlstm_recurrent: the paper's stabilized recurrent form, one step per position --------------

class MLSTMRecurrent(nn.Module):
    """The mLSTM step by step as the xLSTM paper writes its recurrent form, [B, S, NH, DH] layout:

        m_t = max(logsigmoid(f~_t) + m_{t-1}, i~_t)
        i'_t = exp(i~_t - m_t),  f'_t = exp(logsigmoid(f~_t) + m_{t-1} - m_t)
        C_t = f'_t C_{t-1} + i'_t v_t k_t^T,  n_t = f'_t n_{t-1} + i'_t k_t   (k scaled by 1/sqrt(DH))
        h_t = C_t q_t / (max(|n_t^T q_t|, exp(-m_t)) + eps)

    C_t [B, NH, DH(v), DH(k)], n_t [B, NH, DH], m_t [B, NH]; C_0 = n_0 = 0 and m_0 = -inf (no start
    state: f'_1 = exp(-inf) = 0, m_1 = i~_1), so m_t is the running max the parallel form takes as
    its row max and h_t is that form's exactly, eps included. q, k, v from one fused projection
    with the heads interleaved ([NH, 3, DH] columns), both gates from one Linear (2 NH outputs:
    input, forget), the h_t stacked over time."""

    def __init__(self, d: int, nh: int, fp32_rec: bool, eps: float = 1e-6):
        super().__init__()
        self.nh, self.dh, self.fp32_rec, self.eps = nh, d // nh, fp32_rec, eps
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.gates = nn.Linear(d, 2 * nh)
        self.proj = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.gates.bias[:nh].zero_()
            self.gates.bias[nh:] = torch.linspace(3.0, 6.0, nh)

    def forward(self, x):
        B, S, d = x.shape
        q, k, v = self.qkv(x).view(B, S, self.nh, 3, self.dh).unbind(3)  # each [B, S, NH, DH]
        i_pre, f_pre = self.gates(x).chunk(2, dim=-1)  # each [B, S, NH]
        if self.fp32_rec:
            ct = _compute_dtype(x)
            q, k, v, i_pre, f_pre = (t.to(ct) for t in (q, k, v, i_pre, f_pre))
        k = k / math.sqrt(self.dh)
        log_f = F.logsigmoid(f_pre)
        C = q.new_zeros(B, self.nh, self.dh, self.dh)
        n = q.new_zeros(B, self.nh, self.dh)
        m = q.new_full((B, self.nh), float("-inf"))
        hs = []
        for t in range(S):
            q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]
            m_t = torch.maximum(log_f[:, t] + m, i_pre[:, t])
            i_g = torch.exp(i_pre[:, t] - m_t)
            f_g = torch.exp(log_f[:, t] + m - m_t)
            C = f_g[:, :, None, None] * C + i_g[:, :, None, None] * torch.einsum("bhv,bhk->bhvk", v_t, k_t)
            n = f_g[:, :, None] * n + i_g[:, :, None] * k_t
            num = torch.einsum("bhvk,bhk->bhv", C, q_t)
            den = torch.maximum(torch.einsum("bhk,bhk->bh", n, q_t).abs(), torch.exp(-m_t)) + self.eps
            hs.append(num / den[:, :, None])
            m = m_t
        h = torch.stack(hs, dim=1)  # [B, S, NH, DH]
        return self.proj(h.reshape(B, S, d).to(x.dtype))


# --- 10. slstm_paper: the sLSTM cell as the xLSTM paper writes it, states as a tuple ----------------

class SLSTMPaper(nn.Module):
    """The sLSTM with the paper's gate order (i, f, z, o): pre-activations W x_t (one Linear for the
    four gates of every head, computed for the whole sequence before the loop) + R h_{t-1} (R
    [NH, DH, 4 DH]: block-diagonal, one einsum per step) + b [NH, 4 DH];
        m_t = max(logsigmoid(f~) + m_{t-1}, i~),  i' = exp(i~ - m_t),  f' = exp(logsigmoid(f~) + m_{t-1} - m_t)
        c_t = f' c_{t-1} + i' tanh(z~),  n_t = f' n_{t-1} + i',  h_t = sigmoid(o~) c_t / n_t
    The state (h, c, n, m) is one tuple, zeros at the start, in fp32 (fp64 in an fp64 reference);
    the h_t stacked over time."""

    def __init__(self, d: int, nh: int):
        super().__init__()
        self.nh, self.dh = nh, d // nh
        self.W = nn.Linear(d, 4 * d, bias=False)  # columns [NH, 4 (i, f, z, o), DH]
        self.R = nn.Parameter(torch.randn(nh, d // nh, 4 * (d // nh)) / math.sqrt(d // nh))
        self.b = nn.Parameter(torch.zeros(nh, 4, d // nh))
        self.proj = nn.Linear(d, d, bias=False)
        with torch.no_grad():  # forget gates open: 3 .. 6 over the heads' units
            self.b[:, 1] = torch.linspace(3.0, 6.0, d).view(nh, d // nh)

    def forward(self, x):
        B, S, d = x.shape
        st = _compute_dtype(x)
        wx = self.W(x).to(st).view(B, S, self.nh, 4 * self.dh)
        R, b = self.R.to(st), self.b.to(st).view(self.nh, 4 * self.dh)
        zeros = x.new_zeros(B, self.nh, self.dh, dtype=st)
        state = (zeros, zeros, zeros, zeros)  # h, c, n, m
        hs = []
        for t in range(S):
            h, c, n, m = state
            pre = wx[:, t] + torch.einsum("bhd,hdg->bhg", h, R) + b
            i_pre, f_pre, z_pre, o_pre = pre.chunk(4, dim=-1)
            log_f = F.logsigmoid(f_pre)
            m_t = torch.maximum(log_f + m, i_pre)
            i_g, f_g = torch.exp(i_pre - m_t), torch.exp(log_f + m - m_t)
            c_t = f_g * c + i_g * torch.tanh(z_pre)
            n_t = f_g * n + i_g
            h_t = torch.sigmoid(o_pre) * c_t / n_t
            state = (h_t, c_t, n_t, m_t)
            hs.append(h_t)
        return self.proj(torch.stack(hs, dim=1).reshape(B, S, d).to(x.dtype))


# --- the registry -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Form:
    name: str
    make: Callable  # (size, dtype, mode) -> nn.Module (fp32, on the CPU)
    inputs: str  # "embed" [B, S, d], "rows" [M, d], "ids" [B, S]
    unavailable: Callable[[], str] = lambda: ""
    dtypes: tuple = ("bf16", "fp32")


def _mlstm_form(mixer_cls, norm=nn.LayerNorm):
    def make(size, dtype, mode):
        def mixer():
            chunk = (size.get("L", 64),) if mixer_cls is MLSTMChunkwise else ()
            return mixer_cls(size["d"], size["nh"], dtype == "bf16/fp32rec", *chunk)
        return Stack([PreNormBlock(size["d"], mixer(), norm) for _ in range(size.get("blocks", 2))])
    return make


FORMS: dict[str, Form] = {f.name: f for f in (
    Form("mlstm_paper", _mlstm_form(MLSTMPaper), "embed", dtypes=("bf16", "bf16/fp32rec", "fp32")),
    Form("mlstm_einsum", _mlstm_form(MLSTMEinsum, RMSNorm), "embed", dtypes=("bf16", "bf16/fp32rec", "fp32")),
    Form("mlstm_chunkwise", _mlstm_form(MLSTMChunkwise, RMSNorm), "embed", dtypes=("bf16", "bf16/fp32rec", "fp32")),
    Form("slstm_loop", lambda s, dt, mo: Stack([PreNormBlock(s["d"], SLSTMLoop(s["d"], s["nh"]))
                                                for _ in range(s.get("blocks", 2))]), "embed"),
    Form("swiglu_mlp", lambda s, dt, mo: MLPStack(s["d"]), "rows"),
    Form("gemm_chain", lambda s, dt, mo: GemmChain(s["d"]), "rows"),
    Form("hf_xlstm", lambda s, dt, mo: HFCausalLM(s, mo), "ids", hf_unavailable, dtypes=("bf16",)),
    Form("xlstm_stack", lambda s, dt, mo: xlstm_block_stack(s), "embed", xlstm_unavailable, dtypes=("bf16",)),
    Form("mlstm_recurrent", _mlstm_form(MLSTMRecurrent), "embed", dtypes=("bf16", "bf16/fp32rec", "fp32")),
    Form("slstm_paper", lambda s, dt, mo: Stack([PreNormBlock(s["d"], SLSTMPaper(s["d"], s["nh"]), RMSNorm)
                                                 for _ in range(s.get("blocks", 2))]), "embed"),
)}


def size_label(form: str, size: dict) -> str:
    if FORMS[form].inputs == "rows":
        return f"M{size['M']} d{size['d']}"
    s = f"d{size['d']} NH{size['nh']} (DH{size['d'] // size['nh']})"
    if "blocks" in size:
        s += f" {size['blocks']} blocks"
    if size.get("slstm_at"):
        s += f" sLSTM at {','.join(map(str, size['slstm_at']))}"
    if form == "mlstm_chunkwise" and size.get("L", 64) != 64:
        s += f" L{size['L']}"
    return s + f" S{size['S']} B{size['B']}"


def label(row: dict) -> str:
    return f"{row['form']} {size_label(row['form'], row['size'])} {row['dtype']} {row['mode']}"


def tokens(row: dict) -> int:
    s = row["size"]
    return s["M"] if "M" in s else s["B"] * s["S"]


def build(row: dict, device: str):
    """(model, inputs) of a row: the model seeded, cast to the row's dtype and on `device`; inputs a
    tuple (embeddings with unit variance, or token ids)."""
    form, size = FORMS[row["form"]], row["size"]
    torch.manual_seed(row.get("seed", 0))
    model = form.make(size, row["dtype"], row["mode"]).to(device, DTYPES[row["dtype"]])
    model.train(row["mode"] == "train")
    g = torch.Generator(device="cpu").manual_seed(row.get("seed", 0) + 1)
    if form.inputs == "ids":
        x = torch.randint(0, size["vocab"], (size["B"], size["S"]), generator=g)
    elif form.inputs == "rows":
        x = torch.randn(size["M"], size["d"], generator=g)
    else:
        x = torch.randn(size["B"], size["S"], size["d"], generator=g)
    x = x.to(device) if form.inputs == "ids" else x.to(device, DTYPES[row["dtype"]])
    return model, (x,)


def loss_of(row: dict, out: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """The train step's loss: cross-entropy of the logits against the ids for the LM form, else the
    mean square of the output (in fp32)."""
    if FORMS[row["form"]].inputs == "ids":
        return F.cross_entropy(out.float().flatten(0, 1), inputs[0].flatten())
    return out.float().square().mean()


# --- the grid ---------------------------------------------------------------------------------------

def _mlstm_sizes():
    # head dims 64 .. 512, 8k .. 32k tokens, S 128 .. 8192
    out = [dict(d=256, nh=4, S=S, B=16384 // S) for S in (128, 512, 2048, 8192)]
    out += [dict(d=1024, nh=4, S=S, B=16384 // S) for S in (512, 2048, 8192)]
    out += [dict(d=1024, nh=16, S=2048, B=8)]
    out += [dict(d=2048, nh=4, S=512, B=16), dict(d=2048, nh=8, S=2048, B=4)]
    out += [dict(d=4096, nh=8, S=2048, B=4), dict(d=4096, nh=8, S=8192, B=1)]
    return out


# the sizes of issue 57's probe (a user's two-block paper-form model, before the measured choice)
PROBE_SIZES = [dict(d=512, nh=4, S=512, B=8), dict(d=1024, nh=8, S=1024, B=4), dict(d=2048, nh=8, S=4096, B=2)]
SLSTM_SIZES = [dict(d=256, nh=4, S=128, B=32), dict(d=256, nh=4, S=512, B=16), dict(d=512, nh=4, S=256, B=16),
               dict(d=768, nh=4, S=512, B=16), dict(d=1024, nh=4, S=128, B=16), dict(d=1024, nh=8, S=1024, B=8)]
ROW_SIZES = [dict(M=M, d=d) for d in (1024, 2048, 4096) for M in (1, 16, 256, 4096, 16384)]
HF_SIZES = [dict(d=1024, nh=4, blocks=2, S=512, B=4, vocab=50304),
            dict(d=2048, nh=4, blocks=2, S=2048, B=2, vocab=50304),
            dict(d=4096, nh=8, blocks=2, S=2048, B=2, vocab=50304)]
# loops over time unrolled by Dynamo: S at most 256 (the recurrent mLSTM's step is ~15 ops, its
# state B NH DH^2 per position in a train row)
RECURRENT_MLSTM_SIZES = [dict(d=256, nh=4, S=128, B=64), dict(d=256, nh=4, S=256, B=32),
                         dict(d=512, nh=8, S=256, B=16), dict(d=1024, nh=4, S=128, B=16)]
STACK_SIZES = [dict(d=512, nh=4, blocks=2, S=512, B=8), dict(d=512, nh=4, blocks=2, slstm_at=[1], S=256, B=8),
               dict(d=1024, nh=4, blocks=4, S=2048, B=4), dict(d=768, nh=4, blocks=4, slstm_at=[3], S=512, B=8)]


def _rows(form, sizes, dtypes, modes=("fwd", "train")):
    return [dict(form=form, size=dict(s), dtype=dt, mode=mo) for s in sizes for dt in dtypes for mo in modes]


def full_grid() -> list[dict]:
    rows = []
    fp32_mlstm = [dict(d=256, nh=4, S=512, B=32), dict(d=1024, nh=4, S=2048, B=8)]
    for form in ("mlstm_paper", "mlstm_einsum", "mlstm_chunkwise"):
        rows += _rows(form, _mlstm_sizes(), ("bf16", "bf16/fp32rec")) + _rows(form, fp32_mlstm, ("fp32",))
    rows += _rows("mlstm_paper", PROBE_SIZES, ("bf16/fp32rec", "bf16"))
    rows += _rows("slstm_loop", SLSTM_SIZES, ("bf16",)) + _rows("slstm_loop", SLSTM_SIZES[:3], ("fp32",))
    for form in ("swiglu_mlp", "gemm_chain"):
        rows += _rows(form, ROW_SIZES, ("bf16",)) + _rows(form, [dict(M=4096, d=1024), dict(M=4096, d=2048)],
                                                           ("fp32",))
    rows += _rows("hf_xlstm", HF_SIZES, ("bf16",)) + _rows("xlstm_stack", STACK_SIZES, ("bf16",))
    rows += _rows("mlstm_recurrent", RECURRENT_MLSTM_SIZES, ("bf16", "bf16/fp32rec"))
    rows += _rows("mlstm_recurrent", RECURRENT_MLSTM_SIZES[:2], ("fp32",))
    rows += _rows("slstm_paper", SLSTM_SIZES, ("bf16",)) + _rows("slstm_paper", SLSTM_SIZES[:3], ("fp32",))
    return rows


# --quick: each form once at a moderate size, forward and train. Cold first calls dominate: on an
# H100, 40-100 s a row (xaccel's first call also compiles and times the measured choice's Inductor
# candidates), about 10 minutes in all; loops unrolled over time (the sLSTM rows, the chunkwise and
# recurrent mLSTM forms) cost the most compile, hence their short sequences here.
QUICK = [
    dict(form="mlstm_paper", size=dict(d=1024, nh=4, S=2048, B=4), dtype="bf16", mode="fwd"),
    dict(form="mlstm_paper", size=dict(d=1024, nh=4, S=2048, B=4), dtype="bf16/fp32rec", mode="train"),
    dict(form="mlstm_einsum", size=dict(d=1024, nh=8, S=512, B=8), dtype="bf16/fp32rec", mode="fwd"),
    dict(form="mlstm_chunkwise", size=dict(d=1024, nh=4, S=256, B=16), dtype="bf16/fp32rec", mode="fwd"),
    dict(form="slstm_loop", size=dict(d=512, nh=4, S=64, B=32), dtype="bf16", mode="fwd"),
    dict(form="swiglu_mlp", size=dict(M=4096, d=2048), dtype="bf16", mode="train"),
    dict(form="gemm_chain", size=dict(M=16, d=4096), dtype="bf16", mode="fwd"),
    dict(form="hf_xlstm", size=dict(d=1024, nh=4, blocks=2, S=512, B=4, vocab=50304), dtype="bf16", mode="fwd"),
    dict(form="xlstm_stack", size=dict(d=512, nh=4, blocks=2, S=512, B=8), dtype="bf16", mode="fwd"),
    dict(form="mlstm_recurrent", size=dict(d=512, nh=4, S=64, B=16), dtype="bf16/fp32rec", mode="fwd"),
    dict(form="slstm_paper", size=dict(d=512, nh=4, S=64, B=32), dtype="bf16", mode="fwd"),
]

# CPU rows: tiny sizes, each form once per mode (timings are ratios within one process)
CPU = [
    *_rows("mlstm_paper", [dict(d=64, nh=2, S=64, B=2)], ("bf16", "bf16/fp32rec")),
    *_rows("mlstm_einsum", [dict(d=64, nh=2, S=64, B=2)], ("bf16",)),
    *_rows("mlstm_chunkwise", [dict(d=64, nh=2, S=64, B=2, L=16)], ("bf16",)),
    *_rows("slstm_loop", [dict(d=32, nh=2, S=16, B=2)], ("bf16",)),
    *_rows("swiglu_mlp", [dict(M=16, d=64)], ("bf16",)),
    *_rows("gemm_chain", [dict(M=16, d=64)], ("bf16", "fp32")),
    # hidden 128: transformers sizes its cache by hidden / 2 rounded up to 64, its kernels by hidden / 2
    *_rows("hf_xlstm", [dict(d=128, nh=2, blocks=2, S=32, B=2, vocab=256, L=16)], ("bf16",)),
    *_rows("xlstm_stack", [dict(d=64, nh=2, blocks=2, slstm_at=[1], S=32, B=2)], ("bf16",)),
    *_rows("mlstm_recurrent", [dict(d=64, nh=2, S=32, B=2)], ("bf16", "bf16/fp32rec")),
    *_rows("slstm_paper", [dict(d=32, nh=2, S=16, B=2)], ("bf16",)),
]


def grid(quick: bool = False, cpu: bool = False) -> list[dict]:
    if cpu:
        rows = [r for r in CPU if r["mode"] == "fwd" and r["dtype"] == "bf16"] if quick else CPU
    else:
        rows = QUICK if quick else full_grid()
    return [dict(r, size=dict(r["size"])) for r in rows]
