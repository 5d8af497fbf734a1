"""Picks how an xaccel op runs: a kernel provider that takes the case, else the op's reference.

The providers are the families' (families.py), named there by module path and imported at the
first call that can run a kernel (a CUDA tensor, or anywhere under Triton's interpreter), so the
ops never import codegen and a CPU-only run never loads Triton. Tests may register callables too.
A provider returns NotImplemented for a case it does not cover; if it raises (or cannot be
imported), the error is recorded, a warning is shown once, the provider is not tried again for
that case, and the reference runs instead: a broken kernel costs speed, never a wrong answer.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from . import families
from .errors import XaccelFallbackWarning


@dataclass(frozen=True)
class RuntimeFallback:
    op: str
    provider: str
    key: str
    reason: str


class _Provider:
    """A provider callable, or a families.py path resolved on the first call that can run it."""

    __slots__ = ("name", "fn", "path")

    def __init__(self, fn: Callable | None = None, path: str | None = None):
        self.fn, self.path = fn, path
        self.name = path or getattr(fn, "__qualname__", None) or repr(fn)

    def takes(self, args) -> bool:
        """A family's kernels run on CUDA tensors or under the interpreter; a registered callable
        decides for itself."""
        if self.path is None:
            return True
        t = _first_tensor(args)
        return t is not None and kernels_can_run(t)

    def __call__(self, key, *args):
        if self.fn is None:
            self.fn = families.resolve(self.path)
        return self.fn(key, *args)


def _first_tensor(args) -> torch.Tensor | None:
    """The first tensor among the arguments, looking into lists (xaccel::pointwise takes its
    inputs as one list)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            t = next((x for x in a if isinstance(x, torch.Tensor)), None)
            if t is not None:
                return t
    return None


_PROVIDERS: dict[str, list[_Provider]] = {}
# Kernel choices, for reports: case key -> (op, case label, what runs). Providers set them when they
# decide; while explain() runs, SEEN collects the keys of the cases its run actually used.
CHOICES: dict = {}
SEEN: set | None = None


def record_choice(key, op: str, case: str, choice: str) -> None:
    CHOICES[key] = (op, case, choice)


def note_use(key) -> None:
    """Called on every kernel-provider call: one `is None` test unless explain() is collecting."""
    if SEEN is not None:
        SEEN.add(key)


# (op, provider, case key, fp32 matmul precision): a kernel that failed is not retried for its case;
# the precision is part of the case because it picks a different kernel build (TF32 vs 3xTF32)
_BROKEN: set[tuple[str, str, tuple, str]] = set()
EVENTS: list[RuntimeFallback] = []


def _describe(key: tuple) -> str:
    """'cuda:torch.bfloat16:128x4096,16384x4096' for reports (the epilogue string is left out)."""
    shapes = ",".join("x".join(map(str, k)) for k in key if isinstance(k, torch.Size))
    return ":".join(str(k) for k in key[:2]) + ":" + shapes


def interpreting() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1): kernels then run on the CPU, for tests."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_can_run(t: torch.Tensor) -> bool:
    """Generated Triton kernels run on CUDA tensors, or anywhere under the interpreter (tests)."""
    return t.device.type == "cuda" or interpreting()


def _providers(op: str) -> list[_Provider]:
    found = _PROVIDERS.get(op)
    if found is None:
        found = _PROVIDERS[op] = [_Provider(path=p) for p in families.provider_paths(op)]
    return found


def register_provider(op: str, provider: Callable) -> None:
    """provider(key, *args) -> result | NotImplemented, tried after the family's own; `key`
    (hashable) names the case: device, dtype, shapes."""
    _providers(op).append(_Provider(fn=provider))


def unregister_provider(op: str, provider: Callable) -> None:
    found = _providers(op)
    found.remove(next(p for p in found if p.fn is provider and p.path is None))


def dispatch(op: str, key_fn: Callable[..., tuple], reference: Callable, *args):
    """Run the first provider that takes the case, else `reference(*args)`.

    key_fn(*args) names the case; it is only evaluated when a provider may run.
    """
    key = None
    for provider in _providers(op):
        if not provider.takes(args):
            continue
        if key is None:
            key = key_fn(*args)
        name = provider.name
        if _BROKEN and (op, name, key, torch.get_float32_matmul_precision()) in _BROKEN:
            continue
        try:
            out = provider(key, *args)
        except Exception as e:  # noqa: BLE001 - any kernel failure must degrade to the reference
            _BROKEN.add((op, name, key, torch.get_float32_matmul_precision()))
            event = RuntimeFallback(op, name, _describe(key), f"{type(e).__name__}: {e}")
            EVENTS.append(event)
            warnings.warn(f"xaccel: kernel {name} for {op} [{event.key}] failed ({event.reason}); "
                          "running the ATen reference instead", XaccelFallbackWarning, stacklevel=2)
            continue
        if out is not NotImplemented:
            return out
    return reference(*args)
