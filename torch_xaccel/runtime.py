"""Picks how an xaccel op runs on a device: a registered fast kernel, else the op's reference.

Kernel providers are registered per op by the codegen modules. A provider returns NotImplemented
for a case it does not cover; if it raises, the error is recorded, a warning is shown once, the
provider is not tried again for that case, and the reference (ATen composition) runs instead, so
a broken kernel costs speed, never a wrong answer or a crash.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import XaccelFallbackWarning


@dataclass(frozen=True)
class RuntimeFallback:
    op: str
    provider: str
    key: str
    reason: str


_PROVIDERS: dict[str, list[Callable]] = {}
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
_BROKEN: set[tuple[str, str, tuple]] = set()
_NAMES: dict = {}  # provider -> its name in reports (taken at registration: dispatch runs per op call)
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


def register_provider(op: str, provider: Callable) -> None:
    """provider(key, *args) -> result | NotImplemented; `key` (hashable) names the case: device,
    dtype, shapes."""
    _PROVIDERS.setdefault(op, []).append(provider)
    _NAMES[provider] = getattr(provider, "__qualname__", None) or repr(provider)


def unregister_provider(op: str, provider: Callable) -> None:
    _PROVIDERS.get(op, []).remove(provider)


def dispatch(op: str, key_fn: Callable[..., tuple], reference: Callable, *args):
    """Run the first provider that takes the case, else `reference(*args)`.

    key_fn(*args) names the case; it is only evaluated when a provider exists.
    """
    providers = _PROVIDERS.get(op, ())
    key = key_fn(*args) if providers else ()
    for provider in providers:
        name = _NAMES[provider]
        if _BROKEN and (op, name, key) in _BROKEN:
            continue
        try:
            out = provider(key, *args)
        except Exception as e:  # noqa: BLE001 - any kernel failure must degrade to the reference
            _BROKEN.add((op, name, key))
            event = RuntimeFallback(op, name, _describe(key), f"{type(e).__name__}: {e}")
            EVENTS.append(event)
            warnings.warn(f"xaccel: kernel {name} for {op} [{event.key}] failed ({event.reason}); "
                          "running the ATen reference instead", XaccelFallbackWarning, stacklevel=2)
            continue
        if out is not NotImplemented:
            return out
    return reference(*args)
