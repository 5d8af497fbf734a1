"""Environment switches, read afresh at every compile so a user can flip them between calls."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import XaccelConfigError

FALLBACKS = ("eager", "inductor")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


@dataclass(frozen=True)
class Config:
    disable: bool
    patterns: frozenset[str]
    fallback: str
    log: bool
    cache_dir: Path
    keep_mlstm_states: bool = True
    backward_fusion: bool = False  # see backward_fusion(): the default depends on the machine


def _flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise XaccelConfigError(f"{name}={os.environ[name]!r} is invalid; allowed: 0 or 1 (also true/false, yes/no, on/off)")


def tuning_enabled() -> bool:
    """XACCEL_TUNE (default on): off, kernels take their default configs (or a decision already
    stored in the cache) and nothing is timed, which shortens a cold compile by the tuning time."""
    return not os.environ.get("XACCEL_TUNE", "").strip() or _flag("XACCEL_TUNE")


def backward_fusion() -> bool:
    """XACCEL_BACKWARD_FUSION: a training graph's backward also fuses each GEMM with the activation
    gradient or residual add that follows it (lowering/backward.py). Default: on where CUTLASS
    kernels can be built and run (an sm_90 GPU, nvcc, the CUTLASS headers, XACCEL_CUTLASS not 0),
    else off. Measured on the H200 (4-layer MLP train step, interleaved rounds): with the Triton
    kernels only it was slower in 6 of 6 rounds (0.05-0.33 ms of 21.6: they lose to cuBLAS on the
    backward's K x N weight layout); with CUTLASS it was faster in 6 of 6 (0.01-0.88 ms)."""
    if os.environ.get("XACCEL_BACKWARD_FUSION", "").strip():
        return _flag("XACCEL_BACKWARD_FUSION")
    return cutlass_mode() != "0" and cutlass_available()


def cutlass_available() -> bool:
    """An sm_90 GPU is present and nvcc and the CUTLASS headers are installed."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    from .codegen import cutlass_gemm

    return not isinstance(cutlass_gemm.toolchain(), str)


CUTLASS_MODES = ("0", "1", "wait")


def cutlass_mode() -> str:
    """XACCEL_CUTLASS: whether GEMM + epilogue tuning also times generated CUTLASS kernels (built
    with nvcc: about a minute each, once per epilogue and tile config, kept in the cache).
    "1" (default): they build in the background; until they are built the Triton kernels and ATen
    compete alone, then the case is timed again with them (a compile never waits for nvcc).
    "wait": tuning builds them first (reproducible from the first call; benchmarks use it).
    "0": never."""
    raw = os.environ.get("XACCEL_CUTLASS", "").strip().lower() or "1"
    raw = {"on": "1", "true": "1", "yes": "1", "off": "0", "false": "0", "no": "0"}.get(raw, raw)
    if raw not in CUTLASS_MODES:
        raise XaccelConfigError(f"XACCEL_CUTLASS={os.environ['XACCEL_CUTLASS']!r} is invalid; allowed: 0, 1 or wait")
    return raw


def keep_mlstm_states() -> bool:
    """XACCEL_MLSTM_KEEP_STATES (default on): a training graph's mLSTM keeps the state entering
    each chunk for its backward (DQK/64 x v's memory per layer, held until the backward); off,
    the backward recomputes them (0.5-1 ms more per layer and step at the issue's shapes)."""
    return not os.environ.get("XACCEL_MLSTM_KEEP_STATES", "").strip() or _flag("XACCEL_MLSTM_KEEP_STATES")


def leave_to_inductor() -> bool:
    """XACCEL_LEAVE_TO_INDUCTOR (default on; only with XACCEL_FALLBACK=inductor): a GEMM chain whose
    values only feed reductions that Inductor fuses them into (an LM head's softcap feeding the
    cross-entropy) stays with Inductor and cuBLAS instead of becoming a fused kernel
    (lowering/gemm_epilogue.FUSED_INTO)."""
    return not os.environ.get("XACCEL_LEAVE_TO_INDUCTOR", "").strip() or _flag("XACCEL_LEAVE_TO_INDUCTOR")


def compile_threads() -> int:
    """XACCEL_COMPILE_THREADS (default 8): threads that compile tuning candidates concurrently;
    1 compiles them one after another."""
    raw = os.environ.get("XACCEL_COMPILE_THREADS", "").strip()
    if not raw:
        return 8
    if not raw.isdecimal() or not raw.isascii() or int(raw) < 1:
        raise XaccelConfigError(f"XACCEL_COMPILE_THREADS={raw!r} is invalid; allowed: a whole number >= 1")
    return int(raw)


def _patterns(known: tuple[str, ...]) -> frozenset[str]:
    raw = os.environ.get("XACCEL_PATTERNS", "").strip()
    if not raw:
        return frozenset(known)
    names = [p.strip() for p in raw.split(",") if p.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise XaccelConfigError(
            f"XACCEL_PATTERNS={raw!r} is invalid ({', '.join(unknown) or 'empty list'}); "
            f"allowed: a comma-separated subset of {', '.join(known)}")
    return frozenset(names)


def _fallback() -> str:
    raw = os.environ.get("XACCEL_FALLBACK", "eager").strip().lower() or "eager"
    if raw not in FALLBACKS:
        raise XaccelConfigError(f"XACCEL_FALLBACK={os.environ['XACCEL_FALLBACK']!r} is invalid; allowed: {', '.join(FALLBACKS)}")
    return raw


def _cache_dir() -> Path:
    raw = os.environ.get("XACCEL_CACHE_DIR", "").strip()
    path = Path(raw).expanduser() if raw else Path.home() / ".cache" / "torch_xaccel"
    if path.exists() and not path.is_dir():
        raise XaccelConfigError(f"XACCEL_CACHE_DIR={raw!r} is invalid; allowed: a directory path (this one is a file)")
    return path


def load() -> Config:
    """Read every XACCEL_* variable; raise one XaccelConfigError naming the first bad one."""
    from .lowering import FAMILIES_WITH_PASSES

    tuning_enabled()  # a bad XACCEL_TUNE / XACCEL_COMPILE_THREADS fails the compile here, not in a kernel call
    compile_threads()
    leave_to_inductor()
    cutlass_mode()
    return Config(disable=_flag("XACCEL_DISABLE"), patterns=_patterns(FAMILIES_WITH_PASSES),
                  fallback=_fallback(), log=_flag("XACCEL_LOG"), cache_dir=_cache_dir(),
                  keep_mlstm_states=keep_mlstm_states(), backward_fusion=backward_fusion())
