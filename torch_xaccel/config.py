"""Every XACCEL_* environment variable, read and validated in one place into one frozen Config.

The backend loads a Config at every compile (a user may flip a switch between compiles; an
invalid value raises one XaccelConfigError naming the variable and what it accepts). Kernel
providers, which run at call time, take `current()`: the same values, re-read only when the
environment changed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import families
from .errors import XaccelConfigError

FALLBACKS = ("auto", "eager", "inductor")
CUTLASS_MODES = ("0", "1", "wait")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Config:
    # XACCEL_DISABLE (off): run every captured graph as it is
    disable: bool
    # XACCEL_PATTERNS (every pattern, families.PATTERNS): the patterns to
    # replace, a comma-separated subset of families.PATTERNS
    patterns: frozenset[str]
    # XACCEL_FALLBACK (auto): what runs the rest of the graph beside the replacements: eager,
    # inductor, or auto (both are candidates of the measured choice; eager without it)
    fallback: str
    # XACCEL_LOG (off): print each graph's report when it compiles
    log: bool
    # XACCEL_CACHE_DIR (~/.cache/torch_xaccel): rendered kernels, CUTLASS builds, tuning decisions
    cache_dir: Path
    # XACCEL_TUNE (on): time kernel candidates once per shape class; off, a stored decision or the
    # first candidate runs untimed
    tune: bool = True
    # XACCEL_COMPILE_THREADS (8): threads compiling tuning candidates, and concurrent nvcc builds
    compile_threads: int = 8
    # XACCEL_CUTLASS (1): "1" CUTLASS GEMM kernels build in the background and join tuning once
    # built; "wait" tuning builds them first; "0" never
    cutlass: str = "1"
    # XACCEL_BACKWARD_FUSION (unset: on where CUTLASS kernels run): fuse the GEMM chains of
    # training graphs' backward too; None when unset (the gemm_epilogue family decides)
    backward_fusion: bool | None = None
    # XACCEL_LEAVE_TO_INDUCTOR (on; with the Inductor rest): a GEMM chain that only feeds
    # reductions Inductor fuses it into stays with Inductor and cuBLAS
    leave_to_inductor: bool = True
    # XACCEL_MLSTM_KEEP_STATES (on): a training graph's mLSTM keeps the state entering each chunk
    # for its backward (memory for a second sequential scan)
    mlstm_keep_states: bool = True
    # XACCEL_CHOOSE (on): each graph runs as the fastest of its candidates (the replacements with
    # each rest, the captured graph under Inductor, the captured graph as it is), measured at its
    # first call and stored with the kernel tunings (choice.py); off, the replacements always run
    choose: bool = True


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def _flag(name: str, default: bool) -> bool:
    raw = _raw(name).lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise XaccelConfigError(f"{name}={os.environ[name]!r} is invalid; "
                            "allowed: 0 or 1 (also true/false, yes/no, on/off)")


def _patterns() -> frozenset[str]:
    raw, known = _raw("XACCEL_PATTERNS"), families.PATTERNS
    if not raw:
        return frozenset(families.PATTERNS)
    names = [p.strip() for p in raw.split(",") if p.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise XaccelConfigError(
            f"XACCEL_PATTERNS={raw!r} is invalid ({', '.join(unknown) or 'empty list'}); "
            f"allowed: a comma-separated subset of {', '.join(known)}")
    return frozenset(names)


def _fallback() -> str:
    raw = _raw("XACCEL_FALLBACK").lower() or "auto"
    if raw not in FALLBACKS:
        raise XaccelConfigError(f"XACCEL_FALLBACK={os.environ['XACCEL_FALLBACK']!r} is invalid; "
                                f"allowed: {', '.join(FALLBACKS)}")
    return raw


def _cache_dir() -> Path:
    raw = _raw("XACCEL_CACHE_DIR")
    path = Path(raw).expanduser() if raw else Path.home() / ".cache" / "torch_xaccel"
    if path.exists() and not path.is_dir():
        raise XaccelConfigError(f"XACCEL_CACHE_DIR={raw!r} is invalid; allowed: a directory path (this one is a file)")
    return path


def _compile_threads() -> int:
    raw = _raw("XACCEL_COMPILE_THREADS")
    if not raw:
        return 8
    if not raw.isdecimal() or not raw.isascii() or int(raw) < 1:
        raise XaccelConfigError(f"XACCEL_COMPILE_THREADS={raw!r} is invalid; allowed: a whole number >= 1")
    return int(raw)


def _cutlass() -> str:
    raw = _raw("XACCEL_CUTLASS").lower() or "1"
    raw = {"on": "1", "true": "1", "yes": "1", "off": "0", "false": "0", "no": "0"}.get(raw, raw)
    if raw not in CUTLASS_MODES:
        raise XaccelConfigError(f"XACCEL_CUTLASS={os.environ['XACCEL_CUTLASS']!r} is invalid; allowed: 0, 1 or wait")
    return raw


def load() -> Config:
    """Read every XACCEL_* variable now; raise one XaccelConfigError naming the first bad one."""
    backward = _flag("XACCEL_BACKWARD_FUSION", False) if _raw("XACCEL_BACKWARD_FUSION") else None
    return Config(disable=_flag("XACCEL_DISABLE", False), patterns=_patterns(), fallback=_fallback(),
                  log=_flag("XACCEL_LOG", False), cache_dir=_cache_dir(), tune=_flag("XACCEL_TUNE", True),
                  compile_threads=_compile_threads(), cutlass=_cutlass(), backward_fusion=backward,
                  leave_to_inductor=_flag("XACCEL_LEAVE_TO_INDUCTOR", True),
                  mlstm_keep_states=_flag("XACCEL_MLSTM_KEEP_STATES", True), choose=_flag("XACCEL_CHOOSE", True))


_CURRENT: tuple[tuple, Config] | None = None


def current() -> Config:
    """The Config for the environment as it is now, loaded again only when an XACCEL_* variable
    changed (kernels read it at call time, so it must not cost a full load per call)."""
    global _CURRENT
    snapshot = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("XACCEL_")))
    if _CURRENT is None or _CURRENT[0] != snapshot:
        _CURRENT = (snapshot, load())
    return _CURRENT[1]
