"""Library functions that Dynamo traces as xaccel ops instead of their own bodies.

SUBSTITUTIONS lists them. (1) The mlstm_kernels package's native chunkwise mLSTM
(`mlstm_chunkwise__native_autograd`, what xLSTMLarge runs with `chunkwise--native_autograd`)
multiplies fp32 gates into bf16 tensors: in bf16 it raises "expected scalar type Float but found
BFloat16" eagerly and inside Dynamo's own fake-tensor tracing, before any backend sees a graph.
No graph pass can repair that, so torch_xaccel registers a `torch._dynamo.substitute_in_graph`
handler for the function: Dynamo then traces one xaccel::mlstm call with the library's
conventions (start state C = n = 0, m = 0; its states hold k unscaled, ours k / sqrt(DQK)).
Eager calls are untouched.

(2) The xlstm package's `parallel_stabilized_simple` (the mLSTM cell of the older
xLSTMBlockStack): gates shaped [B, NH, S, 1], a cat/repeat construction of the decay matrix and
torch.max, which the parallel-form pass does not match. It is xaccel::mlstm without a state;
only row-wise stabilization is substituted (the other mode has another normalizer floor), and a
causal-mask argument the function would use is checked to be lower-triangular at run time.

Registered as the mlstm family's trace hooks (families.py) when torch_xaccel.backend loads (a
`torch.compile(..., backend="xaccel")` call), once the library is imported; the handler applies
to every Dynamo trace in the process from then on.
XACCEL_DISABLE=1 or an XACCEL_PATTERNS without `mlstm`, read while tracing, make it trace the
library's own code again. The lowering reports each such call as an mlstm replacement.
"""
from __future__ import annotations

import torch

from torch_xaccel import config

from .. import library_hooks

_REGISTERED: set = set()


def traced_here(node) -> bool:
    """Whether an FX node was traced from this file (a substituted library call), by its stack trace."""
    return __file__ in (node.meta.get("stack_trace") or "")


@torch._dynamo.assume_constant_result
def _enabled() -> bool:
    """Read at trace time and baked into the graph (a config change needs a recompile, like
    every other switch)."""
    try:
        cfg = config.current()
    except Exception:  # noqa: BLE001 - an invalid switch is reported by the backend itself
        return False
    return not cfg.disable and "mlstm" in cfg.patterns


@torch._dynamo.assume_constant_result
def _kernel_refusal(device: str, q_dtype, k_dtype, v_dtype, DK: int, DV: int) -> str:
    """Why no kernel would run this call ("" if one would, or off CUDA), evaluated at trace time:
    on a GPU, a call that only the op's chunkwise reference would run stays the library's code,
    which is faster than that reference."""
    if device != "cuda":
        return ""
    from torch_xaccel.codegen import mlstm as kernels

    return kernels.why_not_on_cuda(q_dtype, k_dtype, v_dtype, DK, DV) or ""


def native_chunkwise_as_xaccel(q, k, v, i, f, c_initial=None, n_initial=None, m_initial=None,
                               return_last_states=False, eps=1e-6, chunk_size=64, **kwargs):
    """Same signature and results (to eps-level rounding) as the library function."""
    if not _enabled():
        from mlstm_kernels.torch.chunkwise.native.fw import mlstm_chunkwise_fw

        h, _, _, last, _ = mlstm_chunkwise_fw(matQ=q, matK=k, matV=v, vecI=i, vecF=f, matC_initial=c_initial,
                                             vecN_initial=n_initial, scaM_initial=m_initial,
                                             return_last_states=return_last_states, return_all_states=False,
                                             eps=eps, chunk_size=chunk_size)
        return (h, last) if return_last_states else h
    B, H, _, DK = q.shape
    DV = v.shape[-1]
    root = DK ** 0.5
    if c_initial is None:
        C0 = q.new_zeros(B, H, DK, DV, dtype=torch.float32)
        n0 = q.new_zeros(B, H, DK, dtype=torch.float32)
        m0 = q.new_zeros(B, H, dtype=torch.float32)
    else:
        C0, n0 = c_initial.float() / root, n_initial.float() / root
        m0 = m_initial.float().reshape(B, H)
    h, C, n, m = torch.ops.xaccel.mlstm(q, k, v, i, f, C0, n0, m0, eps, chunk_size)
    if return_last_states:
        return h, (C * root, n * root, m.reshape(B, H, 1))
    return h


def parallel_stabilized_as_xaccel(queries, keys, values, igate_preact, fgate_preact, lower_triangular_matrix=None,
                                  stabilize_rowwise=True, eps=1e-6, **kwargs):
    """Same signature and results (to fp32 rounding; the op computes in fp32 whatever the input
    dtype) as xlstm's parallel_stabilized_simple with row-wise stabilization."""
    S = queries.shape[-2]
    slower = _kernel_refusal(queries.device.type, queries.dtype, keys.dtype, values.dtype,
                             int(queries.shape[-1]), int(values.shape[-1]))
    if not _enabled() or not stabilize_rowwise or slower:
        # run the library's own code eagerly, outside the graph
        torch._dynamo.graph_break(msg=f"xaccel: parallel_stabilized_simple left as written: {slower}" if slower else "")
        from xlstm.blocks.mlstm.backends import parallel_stabilized_simple

        return parallel_stabilized_simple(queries, keys, values, igate_preact, fgate_preact, lower_triangular_matrix,
                                          stabilize_rowwise, eps, **kwargs)
    if lower_triangular_matrix is not None and S >= lower_triangular_matrix.size(-1):
        # the function would use this mask as given: refuse at run time anything but causal
        causal = torch.ones(S, S, dtype=torch.bool, device=queries.device).tril()
        torch._assert_async((lower_triangular_matrix[:S, :S] == causal).all(),
                            "xaccel: parallel_stabilized_simple got a mask that is not lower-triangular")
    h = torch.ops.xaccel.mlstm(queries, keys, values, igate_preact.squeeze(-1), fgate_preact.squeeze(-1),
                               None, None, None, eps, 64)[0]
    return h


# (module, function, traceable replacement)
SUBSTITUTIONS = (
    ("mlstm_kernels.torch.chunkwise.native.fwbw", "mlstm_chunkwise__native_autograd", native_chunkwise_as_xaccel),
    ("xlstm.blocks.mlstm.backends", "parallel_stabilized_simple", parallel_stabilized_as_xaccel),
)
_MODULES = {mod for mod, _, _ in SUBSTITUTIONS}


def register() -> None:
    """Install the handlers of the libraries already imported, and a hook for the others;
    idempotent."""
    library_hooks.register(_MODULES, _install)


def _install(module) -> None:
    for mod, name, replacement in SUBSTITUTIONS:
        fn = getattr(module, name, None) if module.__name__ == mod else None
        if fn is None or id(fn) in _REGISTERED:
            continue
        try:
            torch._dynamo.substitute_in_graph(fn, skip_signature_check=True)(replacement)
        except Exception:  # noqa: BLE001 - another handler already registered: the graph passes still run
            continue
        _REGISTERED.add(id(fn))
