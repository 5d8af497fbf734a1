"""torch.compile's `mode=` and `options=` for the xaccel backend.

`torch.compile(model, backend="xaccel", mode="reduce-overhead")` passes the mode to the backend.
The modes mean what they mean for Inductor: they become Inductor config patches
(`torch._inductor.list_mode_options`), applied to the rest of the graph when
XACCEL_FALLBACK=inductor. With the eager fallback only CUDA graphs have a meaning: the lowered
graph then runs under torch's CUDA graph trees (as the `cudagraphs` backend does), which removes
the per-call Python and launch cost that dominates decoding. An unknown mode or option raises
here, like an invalid XACCEL_* value: a typo must not pass for a setting.
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
            raise XaccelConfigError(f"xaccel backend: unknown option {key!r}{_unknown_option_hint(name)}")
        expected = _plain_type(inductor_config, name)
        if expected is not None and not isinstance(value, expected):
            raise XaccelConfigError(f"xaccel backend: option {key!r} takes a {type(known[name]).__name__}, "
                                    f"got {type(value).__name__}")
        patches[name] = value
    return patches


def _unknown_option_hint(name: str) -> str:
    """What the user may have meant: torch_xaccel's own setting of that name (its key carries the
    `xaccel.` prefix), else the two kinds of key options= takes."""
    from . import config

    if name in config.SETTINGS:
        return f"; did you mean {config.OPTION_PREFIX + name!r}?"
    return f" (options are Inductor config keys, or torch_xaccel's: {', '.join(config.option_keys())})"


def _plain_type(inductor_config, name: str):
    """The declared type of an Inductor config key when isinstance can check it (as torch.compile
    checks options for Inductor), else None."""
    import typing

    get_type = getattr(inductor_config, "get_type", None)
    declared = get_type(name) if get_type is not None else None
    return declared if isinstance(declared, type) and typing.get_origin(declared) is None else None


def describe(mode: str, patches: dict, fallback: str) -> str:
    """The report's line for a compile with settings (empty without any)."""
    if not patches:
        return ""
    label = f"mode={mode}" if mode != "default" else f"options {sorted(patches)}"
    if fallback == "inductor":
        return f"{label}: the rest of the graph by Inductor with these settings"
    if fallback == "auto" and not patches.get(CUDAGRAPHS):
        return f"{label}: the Inductor candidates of the measured choice use these settings"
    if patches.get(CUDAGRAPHS):
        return f"{label}: the rest of the graph eagerly under CUDA graphs (the only setting the eager rest uses)"
    return f"{label}: ignored (these settings only apply to Inductor; XACCEL_FALLBACK=eager)"


def warn_inductor_only(patches: dict) -> None:
    """With the eager fallback only CUDA graphs apply: say so for the rest (e.g. max_autotune)."""
    import warnings

    ignored = sorted(k for k, v in patches.items() if k != CUDAGRAPHS and v)
    if ignored:
        warnings.warn(f"xaccel: {ignored} only apply to Inductor (XACCEL_FALLBACK=inductor); the eager "
                      "fallback ignores them", UserWarning, stacklevel=3)
