"""On-disk cache under XACCEL_CACHE_DIR: rendered kernel sources (readable, named after their op),
built CUTLASS libraries (cutlass/, managed by codegen/cutlass_gemm.py) and tuning decisions. Safe across processes: writes go to a temp file and are renamed into place,
tuning holds a per-key file lock, and an entry that does not parse or names another key is
ignored and rebuilt, never trusted."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from torch_xaccel import config
from torch_xaccel.runtime import interpreting


def root() -> Path:
    path = config.load().cache_dir
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(name: str):
    """Exclusive lock across processes for one cache key (e.g. while tuning it)."""
    path = root() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def key_name(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def read_entry(kind: str, key: str):
    """The stored value for `key`, or None when missing, corrupt or written for another key."""
    path = root() / kind / f"{key_name(key)}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or "value" not in data:
        return None
    return data["value"]


def write_entry(kind: str, key: str, value) -> None:
    atomic_write(root() / kind / f"{key_name(key)}.json", json.dumps({"key": key, "value": value}, indent=1))


def tuning_decision(key: str, valid, tune):
    """The stored tuning value for `key` if `valid(value)`, else `tune()` run under the key's lock
    (another process may have finished meanwhile: re-read first) and stored."""
    value = read_entry("tuning", key)
    if valid(value):
        return value
    with locked(key_name(key)):
        value = read_entry("tuning", key)
        if not valid(value):
            value = tune()
            write_entry("tuning", key, value)
    return value


SHARED_LIMIT = 232448  # bytes of shared memory per block on sm_90 (227 KiB): what a tile config may ask

TUNING_VERSION = 6  # part of every tuning key: bump when candidate lists or timing methods change


def precompile(cands, warmup) -> None:
    """Compile every candidate at once before they are timed: warmup(cfg) runs Triton's warmup
    (compile, no launch) under triton.AsyncCompileMode with a thread pool. The compiler drops the
    GIL for most of its work: on the 2-core CI machine (Triton 3.9, sm_90 target) four GEMM configs
    took 2.9-8.0 s one after another and 3.1-4.8 s on two threads; the GPU host has 16 cores.
    Best effort: a config that fails here is compiled again, and skipped with its error, when timed.
    Not yet measured on the GPU machine."""
    import triton

    mode = getattr(triton, "AsyncCompileMode", None)
    workers = min(len(cands), os.cpu_count() or 1, config.compile_threads())
    if mode is None or workers < 2:
        return
    from concurrent.futures import ThreadPoolExecutor

    active = getattr(getattr(getattr(triton, "runtime", None), "_async_compile", None), "active_mode", None)
    token = active.set(None) if active is not None else None
    try:
        with ThreadPoolExecutor(workers) as pool, mode(pool, ignore_errors=True):
            for cfg in cands:
                try:
                    warmup(cfg)
                except Exception:  # noqa: BLE001 - compiled (or reported) again when timed
                    pass
    except Exception:  # noqa: BLE001 - parallel compilation is an optimisation only
        pass
    finally:
        if token is not None:  # Triton 3.6 leaves the mode set if its exit raises: later compiles must not see it
            active.reset(token)


def fastest(label: str, cands, bench, best=None, best_ms: float = float("inf"), timings: list | None = None):
    """The candidate with the lowest bench(cfg) (ms) below best_ms, else `best`; a candidate whose
    bench raises (does not build, fit or agree) is skipped. A progress bar after two seconds.
    `timings` (a list) receives [cfg, ms or None, why skipped] per candidate, for the tuning entry:
    the report of what was tried."""
    progress = Progress(label, len(cands))
    for n, cfg in enumerate(cands):
        why = ""
        try:
            ms = bench(cfg)
        except Exception as e:  # noqa: BLE001 - a config that does not build, fit or agree is not a candidate
            ms, why = float("inf"), f"{type(e).__name__}: {str(e)[:160]}"
        if timings is not None:
            timings.append([cfg, round(ms, 5) if ms < float("inf") else None, why])
        if ms < best_ms:
            best, best_ms = cfg, ms
        progress.step(n + 1)
    progress.close()
    return best


_MODULES: dict[tuple[str, bool], object] = {}


def load_source(name: str, source: str):
    """Write `source` to kernels/<name>.py (once) and import it. Keyed by name and interpreter
    mode, since Triton decides at decoration time whether a kernel is interpreted."""
    mode = interpreting()
    mod = _MODULES.get((name, mode))
    if mod is not None:
        return mod
    path = root() / "kernels" / f"{name}.py"
    try:
        current = path.read_text()
    except OSError:
        current = None
    if current != source:
        atomic_write(path, source)
    spec = importlib.util.spec_from_file_location(f"torch_xaccel_kernels.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # Triton resolves globals (_tanh) through the module
    spec.loader.exec_module(mod)
    _MODULES[(name, mode)] = mod
    return mod


class Progress:
    """A one-line progress bar on stderr, shown only once tuning has taken over two seconds."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.t0, self.shown = label, total, time.perf_counter(), False

    def step(self, done: int) -> None:
        if time.perf_counter() - self.t0 < 2.0 and not self.shown:
            return
        self.shown = True
        bar = "#" * int(20 * done / self.total)
        sys.stderr.write(f"\r[xaccel] tuning {self.label} [{bar:<20}] {done}/{self.total}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write(f"  {time.perf_counter() - self.t0:.1f}s\n")
