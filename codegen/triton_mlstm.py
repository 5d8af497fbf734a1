"""Generated Triton kernels for xaccel::mlstm (forward) and xaccel::mlstm_step. Rendered per
(initial state or not, input dtype); head dims, chunk size and the DV tile are compile-time
constants of the kernel.

Status: logic checked in Triton's interpreter; GPU timing and tuning are still to come (see the
mLSTM issue). Backward passes run the references."""
from __future__ import annotations

import hashlib

import torch

from . import cache
from .render import _ENV

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256, 512)
_KERNELS: dict = {}


def render(has_state: bool, dtype: torch.dtype, s_constexpr: bool = False) -> tuple[str, str]:
    """s_constexpr: the sequence length as a compile-time constant, for Triton 3.6's interpreter
    (it cannot loop to a run-time bound under NumPy 2)."""
    tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not cache.interpreting()
    precision = "tf32" if tf32 else "ieee"
    key = f"mlstm_fwd|{has_state}|{dtype}|{precision}|{s_constexpr}"
    name = "mlstm_fwd_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    src = _ENV.get_template("mlstm_fwd.py.jinja").render(kernel_name=name, has_state=has_state, dot_dtype=str(dtype),
                                                          precision=precision, s_constexpr=s_constexpr)
    return name, src


def _kernel(has_state: bool, dtype: torch.dtype):
    key = (has_state, dtype, cache.interpreting())
    if key not in _KERNELS:
        name, src = render(has_state, dtype, s_constexpr=cache.interpreting())
        _KERNELS[key] = getattr(cache.load_source(name, src), name)
    return _KERNELS[key]


def config(S: int, DK: int, DV: int) -> tuple[int, int, int]:
    """(chunk length L, DV tile BV, warps): register budget for the state tile [DK, BV] and the
    L x L block. From benchmarks/compile_report.py (sm_90 compile without a GPU): 8 warps cut the
    spills to ~200-370 bytes at both the 128/128 and 256/512 head shapes; not yet timed."""
    L = 64 if DK <= 128 else 32
    BV = min(DV, 64 if DK <= 128 else 32)
    return L, BV, 8


def forward(key, q, k, v, i, f, C0, n0, m0, eps, chunk_size):
    """Kernel path for xaccel::mlstm's forward, or NotImplemented for cases it does not cover.
    chunk_size only shapes the reference's evaluation; the kernel picks its own chunk length
    (results agree to rounding)."""
    B, H, S, DK = q.shape
    DV = v.shape[-1]
    if (q.dtype not in DTYPES or DK not in HEAD_DIMS or DV not in HEAD_DIMS or S == 0
            or not all(t.dtype == q.dtype for t in (k, v))):
        return NotImplemented
    q, k, v = (t.contiguous() for t in (q, k, v))
    i, f = (t.contiguous() for t in (i, f))
    h = torch.empty(B, H, S, DV, dtype=q.dtype, device=q.device)
    C = torch.empty(B, H, DK, DV, dtype=torch.float32, device=q.device)
    n = torch.empty(B, H, DK, dtype=torch.float32, device=q.device)
    m = torch.empty(B, H, dtype=torch.float32, device=q.device)
    has_state = C0 is not None
    if has_state:
        C0, n0, m0 = (t.float().contiguous() for t in (C0, n0, m0))
    else:
        C0, n0, m0 = C, n, m  # unused by the kernel
    L, BV, warps = config(S, DK, DV)
    _kernel(has_state, q.dtype)[(B * H, DV // BV)](q, k, v, i, f, h, C0, n0, m0, C, n, m, S, DK ** -0.5, eps,
                                                   DK=DK, DV=DV, BV=BV, L=L, num_warps=warps)
    return h, C, n, m


def step(key, q, k, v, i, f, C, n, m, eps, scale_q=False):
    """Kernel path for xaccel::mlstm_step, or NotImplemented. Capturable in a CUDA graph (no host
    synchronisation, outputs allocated by the caching allocator)."""
    B, H, DK = q.shape
    DV = v.shape[-1]
    if q.dtype not in DTYPES or DK not in HEAD_DIMS or DV not in HEAD_DIMS or not all(t.dtype == q.dtype for t in (k, v)):
        return NotImplemented
    q, k, v, i, f = (t.contiguous() for t in (q, k, v, i, f))
    C, n, m = (t.float().contiguous() for t in (C, n, m))
    h = torch.empty(B, H, DV, dtype=q.dtype, device=q.device)
    C2, n2, m2 = torch.empty_like(C), torch.empty_like(n), torch.empty_like(m)
    BV = min(DV, 64)
    key = ("step", cache.interpreting())
    if key not in _KERNELS:
        name = "mlstm_step_" + hashlib.sha256(b"mlstm_step|v2").hexdigest()[:12]
        src = _ENV.get_template("mlstm_step.py.jinja").render(kernel_name=name)
        _KERNELS[key] = getattr(cache.load_source(name, src), name)
    q_scale, k_scale = (DK ** -0.5, 1.0) if scale_q else (1.0, DK ** -0.5)
    _KERNELS[key][(B * H, DV // BV)](q, k, v, i, f, C, n, m, h, C2, n2, m2, q_scale, k_scale, eps, DK=DK, DV=DV, BV=BV)
    return h, C2, n2, m2


def backward(key, dh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size):
    """Kernel path for xaccel::mlstm's backward (same contract as ops/mlstm_backward.backward), or
    NotImplemented. The kernel holds whole [DK, DV] states per program: correct for every
    supported head size, tuned for none yet."""
    import torch.nn.functional as F

    from torch_xaccel.ops.mlstm_backward import _route_max_grad

    B, H, S, DK = q.shape
    DV = v.shape[-1]
    if q.dtype not in DTYPES or DK not in HEAD_DIMS or DV not in HEAD_DIMS or S == 0 or dh is None and gC is None:
        return NotImplemented
    if DK * DV > 128 * 128:
        # whole [DK, DV] tiles per program: beyond 128 x 128 they overflow shared memory on sm_90
        # (benchmarks/compile_report.py); the analytic reference runs until the kernel is tiled
        return NotImplemented
    dev, f32 = q.device, torch.float32
    L = 16 if max(DK, DV) > 128 else 32
    NC = -(-S // L)
    q, k, v = (t.contiguous() for t in (q, k, v))
    i32, f32_ = i.float().contiguous(), f.float().contiguous()
    dh = torch.zeros(B, H, S, DV, device=dev, dtype=f32) if dh is None else dh.float().contiguous()
    dC = torch.zeros(B, H, DK, DV, device=dev, dtype=f32) if gC is None else gC.float().clone()
    dn = torch.zeros(B, H, DK, device=dev, dtype=f32) if gn is None else gn.float().clone()
    gm = torch.zeros(B, H, device=dev, dtype=f32) if gm is None else gm.float().contiguous()
    has_state = C0 is not None
    C0s, n0s, m0s = ((C0.float().contiguous(), n0.float().contiguous(), m0.float().contiguous()) if has_state
                     else (dC, dn, gm))  # unused by the kernel without a state
    Cs = torch.empty(B * H * NC * DK * DV, device=dev, dtype=f32)
    ns = torch.empty(B * H * NC * DK, device=dev, dtype=f32)
    ms = torch.empty(B * H * NC, device=dev, dtype=f32)
    dmT = torch.empty(B, H, device=dev, dtype=f32)
    dq, dk = torch.empty(B, H, S, DK, device=dev, dtype=f32), torch.empty(B, H, S, DK, device=dev, dtype=f32)
    dv = torch.empty(B, H, S, DV, device=dev, dtype=f32)
    di, dlogf, dm = (torch.empty(B, H, S, device=dev, dtype=f32) for _ in range(3))
    kkey = ("bwd", has_state, cache.interpreting())
    if kkey not in _KERNELS:
        name = "mlstm_bwd_" + hashlib.sha256(f"mlstm_bwd|{has_state}|{cache.interpreting()}".encode()).hexdigest()[:12]
        src = _ENV.get_template("mlstm_bwd.py.jinja").render(kernel_name=name, has_state=has_state,
                                                              s_constexpr=cache.interpreting())
        _KERNELS[kkey] = getattr(cache.load_source(name, src), name)
    _KERNELS[kkey][(B * H,)](q, k, v, i32, f32_, dh, C0s, n0s, m0s, Cs, ns, ms, dC, dn, gm, dmT,
                              dq, dk, dv, di, dlogf, dm, S, NC, DK ** -0.5, eps, DK=DK, DV=DV, L=L)
    dm[..., -1] += dmT
    logf = F.logsigmoid(f32_)
    r_di, r_dlogf, r_dm0 = _route_max_grad(dm, i32, logf.cumsum(-1), m0s if has_state else None)
    di, dlogf = di + r_di, dlogf + r_dlogf
    df = dlogf * torch.sigmoid(-f32_)
    grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), di.to(i.dtype), df.to(f.dtype)]
    if has_state:
        e0 = torch.exp(m0s)
        grads += [(dC * e0[..., None, None]).to(C0.dtype), (dn * e0[..., None]).to(n0.dtype),
                  (e0 * ((dC * C0s).sum((-1, -2)) + (dn * n0s).sum(-1)) + r_dm0).to(m0.dtype)]
    else:
        grads += [None, None, None]
    return grads
