"""xaccel::mlstm_step — one recurrent mLSTM step for decoding, states in fp32.

    m' = max(logsigmoid(f) + m, i);  f' = exp(logsigmoid(f) + m - m');  i' = exp(i - m')
    C' = f' C + i' k v^T;  n' = f' n + i' k          (k scaled by 1/sqrt(DQK))
    h  = (q^T C') / (max(|q^T n'|, exp(-m')) + eps)

scale_q=True moves the 1/sqrt(DQK) from k to q: h is the same, but the states then hold unscaled
k, the convention of the xlstm package's native step (its states are sqrt(DQK) times ours).

Shapes: q, k [B,H,DQK]; v [B,H,DV]; i, f [B,H]; C [B,H,DQK,DV]; n [B,H,DQK]; m [B,H].
A sequence of these steps from zero states (m = 0) equals xaccel::mlstm with initial state
(0, 0, 0); see ops/mlstm.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import runtime


def reference(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C: Tensor, n: Tensor, m: Tensor,
              eps: float = 1e-6, scale_q: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(h [B,H,DV] in q's dtype, C', n', m') with the states in fp32 (float64 stays float64)."""
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


OP_NAME = "mlstm_step"


def case_key(q, k, v, i, f, C, n, m, eps, scale_q) -> tuple:
    return (q.device.type, q.dtype, q.shape, v.shape)


def _triton_kernels(key, q, *args):
    """Generated Triton step kernel (codegen/triton_mlstm.py) on CUDA, or under the interpreter."""
    if not runtime.kernels_can_run(q):
        return NotImplemented
    from ..codegen import triton_mlstm

    return triton_mlstm.step(key, q, *args)


def run(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C: Tensor, n: Tensor, m: Tensor,
        eps: float, scale_q: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's body: the kernel if it takes the case, else the reference. Compiled forward graphs
    call this directly (ops.DIRECT_CALLS): the custom-op layer is ~6 of the ~16 us of host time a
    step call takes (CPU, tight loop, sixteenth session)."""
    outs = runtime.dispatch(OP_NAME, case_key, reference, q, k, v, i, f, C, n, m, eps, scale_q)
    return tuple(o.contiguous() for o in outs)  # as the fake function promises


@torch.library.custom_op("xaccel::mlstm_step", mutates_args=())
def mlstm_step(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C: Tensor, n: Tensor, m: Tensor,
               eps: float, scale_q: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return run(q, k, v, i, f, C, n, m, eps, scale_q)


runtime.register_provider(OP_NAME, _triton_kernels)


@mlstm_step.register_fake
def _fake(q, k, v, i, f, C, n, m, eps, scale_q=False):
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (q.new_empty(v.shape), C.new_empty(C.shape, dtype=cd), n.new_empty(n.shape, dtype=cd),
            m.new_empty(m.shape, dtype=cd))


def _setup_context(ctx, inputs, output):
    *tensors, eps, scale_q = inputs
    ctx.save_for_backward(*tensors)
    ctx.eps, ctx.scale_q = eps, scale_q


def _backward(ctx, gh, gC, gn, gm):
    from .mlstm import _recompute_grads

    grads = _recompute_grads(lambda *t: reference(*t, eps=ctx.eps, scale_q=ctx.scale_q), list(ctx.saved_tensors),
                             [gh, gC, gn, gm])
    return (*grads, None, None)


mlstm_step.register_autograd(_backward, setup_context=_setup_context)
