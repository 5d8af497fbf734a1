"""The parallel stabilized mLSTM as users spell it, written fresh from the xLSTM paper's equations
(and the xlstm package's cumsum) in styles the project's own code does not use. Each takes q, k, v
[B, NH, S, D] and gates i, f [B, NH, S] and returns h. STRUCTURAL: the spellings the structural
walk takes (no numeric proof: any length, symbolic sizes); PROVEN: spellings it does not know, for
the proof. NO_EPS: the ones without an eps (the op must take none). A spelling that casts to a
compute dtype takes it as `dtype`, so that a float64 truth runs the same code."""
import math

import torch
import torch.nn.functional as F


def paper(q, k, v, i, f, dtype=torch.float32):
    """As the paper writes it, in fp32 whatever the inputs (`dtype`: a float64 truth runs the same
    code in float64): torch.max(...).values, a where against a constant -inf tensor, the
    normalizer with no eps."""
    B, H, S, D = q.shape
    q, k, v, i, f = (t.to(dtype) for t in (q, k, v, i, f))
    Fc = torch.cumsum(F.logsigmoid(f), dim=-1)
    logD = Fc[:, :, :, None] - Fc[:, :, None, :] + i[:, :, None, :]
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool, device=q.device))
    logD = torch.where(causal, logD, torch.tensor(float("-inf"), device=q.device))
    m = torch.max(logD, -1, keepdim=True).values
    C = (q @ k.transpose(-1, -2)) / math.sqrt(D) * torch.exp(logD - m)
    n = torch.maximum(C.sum(-1, keepdim=True).abs(), torch.exp(-m))
    return (C / n) @ v


def tuple_max_float_mask(q, k, v, i, f):
    """m, _ = torch.max(...); a float tril mask compared with 0; the scale on k as a power; torch.max
    for the normalizer."""
    S, D = q.shape[-2:]
    Fc = F.logsigmoid(f).cumsum(-1)
    logD = Fc.unsqueeze(-1) - Fc.unsqueeze(-2) + i.unsqueeze(-2)
    mask = torch.ones(S, S, device=q.device).tril()
    logD = logD.masked_fill(mask == 0, float("-inf"))
    m, _ = torch.max(logD, dim=-1, keepdim=True)
    C = q @ (k * D ** -0.5).transpose(-2, -1) * torch.exp(logD - m)
    n = torch.max(C.sum(-1, keepdim=True).abs(), torch.exp(-m))
    return (C / (n + 1e-6)) @ v


def xlstm_cumsum(q, k, v, i, f):
    """The xlstm package's parallel_stabilized_simple written out: column gates, the zero-padded
    cumsum repeated and subtracted from its transpose, masked before adding i."""
    B, NH, S, DH = q.shape
    i, f = i[..., None], f[..., None]
    ltr = torch.tril(torch.ones((S, S), dtype=torch.bool, device=q.device))
    cs = torch.cat([torch.zeros((B, NH, 1, 1), dtype=q.dtype, device=q.device),
                    torch.cumsum(F.logsigmoid(f), dim=-2)], dim=-2)
    rep = cs.repeat(1, 1, 1, S + 1)
    logfg = torch.where(ltr, (rep - rep.transpose(-2, -1))[:, :, 1:, 1:], -float("inf"))
    logD = logfg + i.transpose(-2, -1)
    max_logD, _ = torch.max(logD, dim=-1, keepdim=True)
    C = (q @ (k / math.sqrt(DH)).transpose(-2, -1)) * torch.exp(logD - max_logD)
    normalizer = torch.maximum(C.sum(dim=-1, keepdim=True).abs(), torch.exp(-max_logD))
    return (C / (normalizer + 1e-6)) @ v


def einsum_scale_last(q, k, v, i, f):
    """einsum products, the scale multiplied last, max(...)[0], a triu mask, exp(-m) first."""
    S, D = q.shape[-2:]
    Fc = torch.cumsum(F.logsigmoid(f), -1)
    logD = (Fc[..., :, None] - Fc[..., None, :] + i[..., None, :]).masked_fill(
        torch.triu(torch.ones(S, S, dtype=torch.bool, device=q.device), 1), -math.inf)
    m = logD.max(-1, keepdim=True)[0]
    C = torch.einsum("bhtd,bhsd->bhts", q, k) * torch.exp(logD - m) * D ** -0.5
    n = torch.maximum(torch.exp(-m), C.sum(-1, keepdim=True).abs())
    return torch.einsum("bhts,bhsd->bhtd", C / (n + 1e-6), v)


def arange_mask_before_i(q, k, v, i, f):
    """A causal mask from aranges, applied to the forget-gate matrix before adding i; log(sigmoid)
    for the log forget gate; q scaled; no eps."""
    S, D = q.shape[-2:]
    t = torch.arange(S, device=q.device)
    logf = torch.log(torch.sigmoid(f)).cumsum(-1)
    decay = torch.where(t[:, None] >= t[None, :], logf[..., :, None] - logf[..., None, :], float("-inf"))
    logD = decay + i[..., None, :]
    m = logD.amax(-1, keepdim=True)
    C = torch.exp(logD - m) * ((q / math.sqrt(D)) @ k.transpose(-2, -1))
    return (C / torch.maximum(C.sum(-1, keepdim=True).abs(), torch.exp(-m))) @ v


def where_drop_branch_softplus(q, k, v, i, f):
    """where(upper, -inf, logD) (the fill in the first branch), -softplus(-f), a bool cast of a
    float tril mask, einsum with k read as [D, S]."""
    S, D = q.shape[-2:]
    Fc = (-F.softplus(-f)).cumsum(dim=2)
    keep = torch.ones(S, S, device=q.device).tril().bool()
    logD = torch.where(~keep, float("-inf"), Fc[..., :, None] - Fc[..., None, :] + i[..., None, :])
    m = torch.amax(logD, dim=-1, keepdim=True)
    C = torch.einsum("bhtd,bhds->bhts", q, k.transpose(-1, -2) / math.sqrt(D)) * torch.exp(logD - m)
    n = torch.maximum(C.sum(-1, keepdim=True).abs(), torch.exp(-m)) + 1e-6
    return torch.einsum("bhts,bhsd->bhtd", C / n, v)


def _reciprocal(q, k, v, i, f, eps):
    S, D = q.shape[-2:]
    Fc = F.logsigmoid(f).cumsum(-1)
    logD = (Fc[..., :, None] - Fc[..., None, :] + i[..., None, :]).masked_fill(
        ~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    m = logD.amax(-1, keepdim=True)
    C = q @ k.transpose(-2, -1) * torch.exp(logD - m) / math.sqrt(D)
    n = torch.maximum(C.sum(-1, keepdim=True).abs(), torch.exp(-m))
    return (C * torch.reciprocal(n + eps if eps else n)) @ v


def reciprocal_normalizer(q, k, v, i, f):
    """The normalizer applied as a reciprocal: not a spelling the walk knows, proven instead."""
    return _reciprocal(q, k, v, i, f, eps=None)


def reciprocal_normalizer_eps(q, k, v, i, f):
    """The same with an eps, added inside the reciprocal."""
    return _reciprocal(q, k, v, i, f, eps=1e-6)


STRUCTURAL = [paper, tuple_max_float_mask, xlstm_cumsum, einsum_scale_last, arange_mask_before_i,
              where_drop_branch_softplus]
PROVEN = [reciprocal_normalizer, reciprocal_normalizer_eps]
NO_EPS = {paper, arange_mask_before_i, reciprocal_normalizer}


def inputs(B=2, H=2, S=40, D=8, seed=0, expose_eps=False, grad=True):
    """Fresh random q, k, v, i, f. expose_eps: small q k^T and large input gates, where the row sum
    is tiny against exp(-m) and an eps changes the result."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    i, f = torch.randn(B, H, S, generator=g), torch.randn(B, H, S, generator=g) + 2
    if expose_eps:
        q, i = q * 1e-4, i + 20
    return [t.requires_grad_(grad) for t in (q, k, v, i, f)]
