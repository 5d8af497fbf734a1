"""torch_xaccel's settings: one Config, one table (SETTINGS), four sources.

Each setting is a field of Config: the shared ones (SharedConfig's, below), then each family's own,
declared in its registry entry (families.Family.settings) and added here, so this module names no
family's setting. SETTINGS maps each to its environment variable (`XACCEL_<FIELD>`), its
torch.compile option key (`xaccel.<field>`), its parser and its help; nothing else names them.
A setting takes, lowest precedence first:

1. its default (Config's field default);
2. its environment variable, read again at every compile;
3. `torch_xaccel.config.patch(...)`, a context manager and decorator like
   `torch._inductor.config.patch` (process-wide while active, not thread-local);
4. `torch.compile(model, backend="xaccel", options={"xaccel.<field>": value})`, for that
   compile only (the other keys of `options` stay Inductor's).

The backend reads its Config when Dynamo compiles a graph, i.e. at the compiled model's first call
(and at recompiles), not at torch.compile(): a patch must be active around that call. A value
baked into a compiled graph stays until it recompiles (torch._dynamo.reset()), as with Inductor's
config. Kernel providers, which build and tune kernels at call time, take `current()`: the same
layers as they are at that call, plus the options of the graph that runs (see `applying`).

An invalid value raises XaccelConfigError naming the source (variable, option key or patch
keyword) and what it accepts: config.patch at its call, options and variables at the compile
(the first call), where it escapes Dynamo as itself (errors.at_compile).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, make_dataclass, replace
from pathlib import Path
from typing import Any

from . import families
from .errors import XaccelConfigError

FALLBACKS = ("auto", "eager", "inductor")
ENV_PREFIX, OPTION_PREFIX = "XACCEL_", "xaccel."
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class SharedConfig:
    """The settings every family shares; Config adds the families' own (below)."""
    disable: bool = False
    patterns: frozenset[str] = field(default_factory=lambda: frozenset(families.PATTERNS))
    fallback: str = "auto"
    log: bool = False
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "torch_xaccel")
    tune: bool = True
    compile_threads: int = 8
    choose: bool = True


class _Invalid(ValueError):
    """A parser's refusal: what it accepts, and optionally what was wrong."""

    def __init__(self, allowed: str, detail: str = ""):
        super().__init__(allowed)
        self.allowed, self.detail = allowed, detail


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower() if isinstance(value, str) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise _Invalid("0 or 1 (also true/false, yes/no, on/off)")


def _optional_flag(value: Any) -> bool | None:
    return None if value is None else _flag(value)


def _patterns(value: Any) -> frozenset[str]:
    known = families.PATTERNS
    allowed = f"a comma-separated subset of {', '.join(known)}"
    if isinstance(value, str):
        names = [p.strip() for p in value.split(",") if p.strip()]
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping)):
        names = [p.strip() if isinstance(p, str) else p for p in value]
    else:
        raise _Invalid(allowed + " (a string or a list of names)")
    unknown = [str(n) for n in names if n not in known]
    if unknown or not names:
        raise _Invalid(allowed, ", ".join(unknown) or "empty list")
    return frozenset(names)


def _fallback(value: Any) -> str:
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in FALLBACKS:
        raise _Invalid(", ".join(FALLBACKS))
    return text


def _cache_dir(value: Any) -> Path:
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise _Invalid("a directory path")
    path = Path(str(value).strip() if isinstance(value, str) else value).expanduser()
    if path.exists() and not path.is_dir():
        raise _Invalid("a directory path (this one is a file)")
    return path


def _compile_threads(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    text = value.strip() if isinstance(value, str) else ""
    if text.isdecimal() and text.isascii() and int(text) >= 1:
        return int(text)
    raise _Invalid("a whole number >= 1")


def _choice(words: tuple[str, ...]) -> Callable[[Any], str]:
    """A parser taking one of `words` (any case); where they hold "0" and "1", also a flag's
    spellings for them (True, "on", ...)."""
    allowed = " or ".join(filter(None, (", ".join(words[:-1]), words[-1])))

    def parse(value: Any) -> str:
        if {"0", "1"} <= set(words):
            with contextlib.suppress(_Invalid):
                value = str(int(_flag(value)))
        text = value.strip().lower() if isinstance(value, str) else None
        if text not in words:
            raise _Invalid(allowed)
        return text
    return parse


def _kind_parser(s: families.FamilySetting) -> Callable[[Any], Any]:
    """A family setting's parser, named by its kind (families.FamilySetting.kind)."""
    if s.kind == "choice" and s.choices:
        return _choice(s.choices)
    if s.kind in ("flag", "optional_flag") and not s.choices:
        return _flag if s.kind == "flag" else _optional_flag
    raise ValueError(f"setting {s.name!r} has kind {s.kind!r} and choices {s.choices!r}; the kinds are flag, "
                     "optional_flag (neither with choices) and choice (with them)")


@dataclass(frozen=True)
class Setting:
    """One row of the table: a Config field, how a raw value becomes its value, and its help.
    The environment variable and the option key follow from the name."""
    name: str
    parse: Callable[[Any], Any]
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def option(self) -> str:
        return OPTION_PREFIX + self.name


_SHARED: tuple[Setting, ...] = (
    Setting("disable", _flag, "run every captured graph as it is (default off)"),
    Setting("patterns", _patterns, "the patterns to replace, a comma-separated subset of families.PATTERNS "
                                   "(default: every pattern)"),
    Setting("fallback", _fallback, "what runs the rest of the graph beside the replacements: eager, inductor, "
                                   "or auto (both are candidates of the measured choice; eager without it)"),
    Setting("log", _flag, "log each graph's report and choice at INFO on the torch_xaccel logger even where "
                          "TORCH_LOGS does not enable it (default off)"),
    Setting("cache_dir", _cache_dir, "rendered kernels, CUTLASS builds, tuning decisions "
                                     "(default ~/.cache/torch_xaccel)"),
    Setting("tune", _flag, "time kernel candidates once per shape class; off, a stored decision or the first "
                           "candidate runs untimed (default on)"),
    Setting("compile_threads", _compile_threads, "threads compiling tuning candidates, and concurrent nvcc "
                                                 "builds (default 8)"),
    Setting("choose", _flag, "each graph runs as the fastest of its candidates, measured at its first call and "
                             "stored with the kernel tunings (choice.py); off, the replacements always run "
                             "(default on)"),
)
assert [s.name for s in _SHARED] == [f.name for f in fields(SharedConfig)], \
    "the shared rows and SharedConfig must list the same fields"


def family_settings(declared: Iterable[families.Family]) -> dict[str, families.FamilySetting]:
    """name -> setting, for every family's own settings in the families' order. A name declared
    twice (by two families, or by a family and the shared settings), an unknown kind or a default
    its parser refuses raises ValueError: at import, since the table below is built from them."""
    owner = dict.fromkeys((s.name for s in _SHARED), "shared")
    out = {}
    for family in declared:
        for s in family.settings:
            if s.name in owner:
                raise ValueError(f"the setting {s.name!r} of family {family.name!r} is also {owner[s.name]}: "
                                 f"a setting's name (XACCEL_{s.name.upper()}) is the whole process's")
            try:
                ok = _kind_parser(s)(s.default) == s.default
            except _Invalid:
                ok = False
            if not ok:
                raise ValueError(f"family {family.name!r}'s setting {s.name!r}: its default {s.default!r} is not "
                                 f"a value its kind {s.kind!r} takes")
            owner[s.name], out[s.name] = f"the {family.name} family's", s
    return out


_FAMILY_SETTINGS = family_settings(families.FAMILIES)
SETTINGS: dict[str, Setting] = {s.name: s for s in _SHARED} | {
    name: Setting(name, _kind_parser(s), s.help) for name, s in _FAMILY_SETTINGS.items()}

Config = make_dataclass("Config", [(name, Any, field(default=s.default)) for name, s in _FAMILY_SETTINGS.items()],
                        bases=(SharedConfig,), frozen=True)
Config.__module__ = __name__  # (pickles as torch_xaccel.config.Config)
Config.__doc__ = """The settings one compile (or one kernel build) uses: SharedConfig's fields, then every
family's own (families.Family.settings), each a field as the shared ones are. Their help is in SETTINGS."""
assert list(SETTINGS) == [f.name for f in fields(Config)], "SETTINGS and Config must list the same fields"

# Read when a kernel is built or tuned (at any call), not only when a graph compiles.
KERNEL_SETTINGS = frozenset({"cache_dir", "tune", "compile_threads"} |
                            {name for name, s in _FAMILY_SETTINGS.items() if s.at_call})


def _parse(setting: Setting, value: Any, shown: str) -> Any:
    """setting's value from a raw one; `shown` is how the user wrote it, for the error."""
    try:
        return setting.parse(value)
    except _Invalid as e:
        detail = f" ({e.detail})" if e.detail else ""
        raise XaccelConfigError(f"{shown} is invalid{detail}; allowed: {e.allowed}") from None


def option_keys() -> list[str]:
    """Every `xaccel.*` key torch.compile's options accept."""
    return [s.option for s in SETTINGS.values()]


def _environment() -> dict[str, Any]:
    """Field -> value for each XACCEL_* variable set (an empty one counts as unset)."""
    out = {}
    for s in SETTINGS.values():
        raw = os.environ.get(s.env, "")
        if raw.strip():
            out[s.name] = _parse(s, raw, f"{s.env}={raw!r}")
    return out


def split_options(options: Mapping | None) -> tuple[dict[str, Any], dict]:
    """torch.compile's options -> (field -> value for the `xaccel.*` keys, validated; the other
    keys, for Inductor). An unknown `xaccel.*` key raises with the list of valid ones."""
    ours, rest = {}, {}
    for key, value in (options or {}).items():
        if not (isinstance(key, str) and key.startswith(OPTION_PREFIX)):
            rest[key] = value
            continue
        setting = SETTINGS.get(key[len(OPTION_PREFIX):])
        if setting is None:
            raise XaccelConfigError(f"unknown option {key!r}; the xaccel options are {', '.join(option_keys())}")
        ours[setting.name] = _parse(setting, value, f"options={{{key!r}: {value!r}}}")
    return ours, rest


# -- config.patch ---------------------------------------------------------------------------------

_PATCHES: list[tuple[object, dict[str, Any]]] = []  # (token, field -> value), oldest first
_PATCH_LOCK = threading.Lock()
_PATCH_VERSION = 0


class patch(contextlib.ContextDecorator):  # noqa: N801 - named like torch._inductor.config.patch
    """Override settings while a `with` block or a decorated function runs, over the environment
    variables (torch.compile's `xaccel.*` options still win for their compile):

        with torch_xaccel.config.patch(fallback="eager", patterns="mlstm,gemm_epilogue"):
            out = compiled(x)          # the first call compiles: the patch must hold here

        @torch_xaccel.config.patch({"fallback": "eager"})
        def step(x): ...

    Keys are Config's field names (also accepted as their option keys, "xaccel.fallback");
    `patch("fallback", "eager")` works too. Values are checked here, at the call: an unknown key
    or an invalid value raises XaccelConfigError. Patches nest, restore the settings on exit (also
    on an exception) and apply to the whole process while active, like Inductor's."""

    def __init__(self, changes: Mapping[str, Any] | str | None = None, value: Any = None, /, **kwargs: Any):
        if isinstance(changes, str):
            changes = {changes: value}
        elif value is not None:
            raise TypeError("config.patch(name, value) takes a setting's name first")
        merged = {**(changes or {}), **kwargs}
        self.changes: dict[str, Any] = {}
        for key, val in merged.items():
            name = key[len(OPTION_PREFIX):] if isinstance(key, str) and key.startswith(OPTION_PREFIX) else key
            setting = SETTINGS.get(name)
            if setting is None:
                raise XaccelConfigError(f"config.patch: unknown setting {key!r}; the settings are "
                                        f"{', '.join(SETTINGS)}")
            self.changes[name] = _parse(setting, val, f"config.patch({name}={val!r})")
        self._tokens: list[object] = []

    def __enter__(self) -> patch:
        global _PATCH_VERSION
        token = object()
        with _PATCH_LOCK:
            _PATCHES.append((token, dict(self.changes)))
            _PATCH_VERSION += 1
        self._tokens.append(token)
        return self

    def __exit__(self, *exc) -> None:
        global _PATCH_VERSION
        token = self._tokens.pop()
        with _PATCH_LOCK:
            _PATCHES[:] = [p for p in _PATCHES if p[0] is not token]
            _PATCH_VERSION += 1


def _patched() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with _PATCH_LOCK:
        for _token, changes in _PATCHES:
            out.update(changes)
    return out


# -- per-compile overrides (options) --------------------------------------------------------------

_LOCAL = threading.local()  # .overrides: the active compile's or graph's options, field -> value


def _frozen(overrides: Mapping[str, Any]) -> tuple:
    return tuple(sorted(overrides.items()))


@contextlib.contextmanager
def applying(overrides: Mapping[str, Any]):
    """While the backend compiles a graph, or a graph compiled with options runs: `current()` in
    this thread takes these options (field -> value, validated) over every other source."""
    prior = getattr(_LOCAL, "overrides", None)
    _LOCAL.overrides = _frozen(overrides)
    try:
        yield
    finally:
        _LOCAL.overrides = prior


def active_overrides() -> dict[str, Any]:
    """The options `current()` applies in this thread now (empty outside a compile or graph)."""
    return dict(getattr(_LOCAL, "overrides", None) or ())


def calling_with(fn: Callable, overrides: Mapping[str, Any]) -> Callable:
    """fn, run with `overrides` applied when they hold settings read at call time (kernel builds
    and tuning); fn itself otherwise (no wrapper: nothing to apply)."""
    kept = _frozen({k: v for k, v in overrides.items() if k in KERNEL_SETTINGS})
    if not kept:
        return fn

    def run(*args):  # (applying's work, without a context manager or a sort on every call)
        prior = getattr(_LOCAL, "overrides", None)
        _LOCAL.overrides = kept
        try:
            return fn(*args)
        finally:
            _LOCAL.overrides = prior
    run._boxed_call = getattr(fn, "_boxed_call", False)  # (a boxed function stays boxed)
    return run


def _traced_options() -> tuple:
    """The `xaccel.*` options of the torch.compile call whose frame Dynamo traces in this thread
    now (library substitutions read the config while Dynamo traces, before the backend runs),
    validated; () when not tracing for xaccel, when an option is invalid, or when torch's
    internals differ (best effort: Dynamo's translator -> its OutputGraph's compiler_fn ->
    WrapBackendDebug._torchdynamo_orig_backend -> torch.compile's wrapper .kwargs; torch 2.11-2.14)."""
    convert = sys.modules.get("torch._dynamo.symbolic_convert")
    tx = getattr(getattr(convert, "tls", None), "current_tx", None)
    if tx is None:
        return ()
    try:
        fn = getattr(getattr(tx, "output", None), "compiler_fn", None)
        for _ in range(6):  # WrapBackendDebug -> torch.compile's wrapper (kwargs, compiler_fn) -> the backend
            if fn is None:
                return ()
            kwargs = getattr(fn, "kwargs", None)
            inner = getattr(fn, "compiler_fn", None)
            if isinstance(kwargs, dict) and inner is not None:
                if getattr(inner, "__name__", "") != "xaccel_backend":
                    return ()
                return _frozen(split_options(kwargs.get("options"))[0])
            fn = getattr(fn, "_torchdynamo_orig_backend", None) or inner
    except Exception:  # noqa: BLE001 - an invalid option (the backend raises it itself, once it runs)
        return ()      # or torch's internals moved: no options seen while tracing
    return ()


# -- reading ---------------------------------------------------------------------------------------

def load(options: Mapping[str, Any] | None = None) -> Config:
    """The Config now: defaults, then the XACCEL_* variables (read now), then the active
    config.patch, then `options` (field -> value, already validated by split_options; a compile's
    own). Raises one XaccelConfigError naming the first bad variable."""
    values = {**_environment(), **_patched(), **(options or {})}
    return replace(Config(), **values)


def describe(cfg: Config, options: Mapping[str, Any] | None = None) -> str:
    """Every setting of cfg, each one not at its default with where it came from (the debug log):
    "disable=False, ..., fallback='eager' [config.patch], choose=False [XACCEL_CHOOSE]"."""
    where = {s.name: s.env for s in SETTINGS.values() if os.environ.get(s.env, "").strip()}
    where.update(dict.fromkeys(_patched(), "config.patch"))
    where.update({k: f"options[{SETTINGS[k].option!r}]" for k in options or {}})
    parts = []
    for name in SETTINGS:
        value = getattr(cfg, name)
        shown = ("every pattern" if value == frozenset(families.PATTERNS) else ",".join(sorted(value))) \
            if name == "patterns" else repr(str(value) if isinstance(value, Path) else value)
        parts.append(f"{name}={shown}" + (f" [{where[name]}]" if name in where else ""))
    return ", ".join(parts)


@functools.lru_cache(maxsize=64)
def _cached(snapshot: tuple, version: int, overrides: tuple) -> Config:
    return load(dict(overrides))


def current() -> Config:
    """The Config for this moment: loaded again only when an XACCEL_* variable, the active
    config.patch or the options in effect (a graph compiled with options running, or Dynamo tracing
    for such a compile) changed; kernels read it at call time, so it must not cost a full load per
    call."""
    snapshot = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIX)))
    overrides = getattr(_LOCAL, "overrides", None)
    if overrides is None:
        overrides = _traced_options()
    return _cached(snapshot, _PATCH_VERSION, overrides)
