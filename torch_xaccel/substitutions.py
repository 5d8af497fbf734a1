"""Library functions that Dynamo traces as xaccel ops instead of their own bodies.

The mlstm_kernels package's native chunkwise mLSTM (`mlstm_chunkwise__native_autograd`, what
xLSTMLarge runs with `chunkwise--native_autograd`) multiplies fp32 gates into bf16 tensors: in
bf16 it raises "expected scalar type Float but found BFloat16" eagerly and inside Dynamo's own
fake-tensor tracing, before any backend sees a graph. No graph pass can repair that, so
torch_xaccel registers a `torch._dynamo.substitute_in_graph` handler for the function: Dynamo
then traces one xaccel::mlstm call with the library's conventions (start state C = n = 0, m = 0;
its states hold k unscaled, ours k / sqrt(DQK)). Eager calls are untouched.

Registered when torch_xaccel.backend loads (a `torch.compile(..., backend="xaccel")` call), once
the library is imported; the handler applies to every Dynamo trace in the process from then on.
XACCEL_DISABLE=1 or an XACCEL_PATTERNS without `mlstm`, read while tracing, make it trace the
library's own code again. The lowering reports each such call as an mlstm replacement.
"""
from __future__ import annotations

import importlib.abc
import sys

import torch

from . import config

MODULE = "mlstm_kernels.torch.chunkwise.native.fwbw"
FUNCTION = "mlstm_chunkwise__native_autograd"
FILE_MARK = "torch_xaccel/substitutions.py"  # how the lowering recognises the calls traced from here
_REGISTERED: set = set()


@torch._dynamo.assume_constant_result
def _enabled() -> bool:
    """Read at trace time and baked into the graph (a config change needs a recompile, like
    every other switch)."""
    try:
        cfg = config.load()
    except Exception:  # noqa: BLE001 - an invalid switch is reported by the backend itself
        return False
    return not cfg.disable and "mlstm" in cfg.patterns


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


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers the handler right after the library module is imported, when that happens after
    torch_xaccel.backend loaded (importing the library eagerly would cost ~4 s)."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None and spec.loader is not None:
                    self._inner = spec.loader
                    spec.loader = self
                    return spec
        return None

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _install(getattr(module, FUNCTION, None))


def register() -> None:
    """Install the handler now if the library is imported, else as soon as it is; idempotent."""
    mod = sys.modules.get(MODULE)
    if mod is None:
        if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
        return
    _install(getattr(mod, FUNCTION, None))


def _install(fn) -> None:
    if fn is None or id(fn) in _REGISTERED:
        return
    try:
        torch._dynamo.substitute_in_graph(fn, skip_signature_check=True)(native_chunkwise_as_xaccel)
    except Exception:  # noqa: BLE001 - another handler already registered: the graph pass still finds it
        return
    _REGISTERED.add(id(fn))
