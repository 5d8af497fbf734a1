"""torch.compile's `mode=` and `options=` for the xaccel backend.

`torch.compile(model, backend="xaccel", mode="reduce-overhead")` passes the mode to the backend;
the backend used to ignore it silently. The modes mean what they mean for Inductor: they become
Inductor config patches (`torch._inductor.list_mode_options`), applied to the rest of the graph
when XACCEL_FALLBACK=inductor. With the eager fallback only CUDA graphs have a meaning: the
lowered graph then runs under torch's CUDA graph trees (as the `cudagraphs` backend does), which
removes the per-call Python and launch cost that dominates decoding. An unknown mode or option
raises here, like an invalid XACCEL_* value: a typo must not pass for a setting.
"""
from __future__ import annotations

CUDAGRAPHS = "triton.cudagraphs"


def rest_options(kwargs: dict) -> dict:
    """Inductor config patches asked for by torch.compile's mode= and options= (empty: none)."""
    import torch._inductor
    from torch._inductor import config as inductor_config

    from .errors import XaccelConfigError

    unexpected = sorted(set(kwargs) - {"mode", "options"})
    if unexpected:
        raise TypeError(f"xaccel backend: unexpected arguments {unexpected} (torch.compile passes mode= and options=)")
    modes = torch._inductor.list_mode_options()
    mode = kwargs.get("mode") or "default"
    if mode not in modes:
        raise XaccelConfigError(f"xaccel backend: unknown mode={mode!r}; known: {sorted(modes)}")
    patches = dict(modes[mode])
    known = inductor_config.get_config_copy()
    for key, value in (kwargs.get("options") or {}).items():
        name = key.replace("-", "_")
        if name not in known:
            raise XaccelConfigError(f"xaccel backend: unknown option {key!r} (options are Inductor config keys)")
        patches[name] = value
    return patches


def warn_inductor_only(patches: dict) -> None:
    """With the eager fallback only CUDA graphs apply: say so for the rest (e.g. max_autotune)."""
    import warnings

    ignored = sorted(k for k, v in patches.items() if k != CUDAGRAPHS and v)
    if ignored:
        warnings.warn(f"xaccel: {ignored} only apply to Inductor (XACCEL_FALLBACK=inductor); the eager "
                      "fallback ignores them", UserWarning, stacklevel=3)
