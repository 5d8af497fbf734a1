"""On-disk cache under XACCEL_CACHE_DIR: rendered kernel sources (kernels/, readable, named after
their op), built CUTLASS libraries (cutlass/, managed by codegen/gemm_epilogue/cutlass_kernels.py)
and tuning decisions (tuning/). Safe across processes: writes go to a temp file and are renamed
into place, tuning holds a per-key file lock, and an entry that does not parse or names another
key is ignored and rebuilt, never trusted."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

from torch_xaccel import config
from torch_xaccel.runtime import interpreting

_MADE: set = set()


def root() -> Path:
    """XACCEL_CACHE_DIR as the environment sets it now, created on first use."""
    path = config.current().cache_dir
    if path not in _MADE:
        path.mkdir(parents=True, exist_ok=True)
        _MADE.add(path)
    return path


def atomic_write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:  # a full disk, or a directory where the file goes: no half file left
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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


_MODULES: dict[tuple[str, bool], object] = {}


_TEMPLATE_KERNELS: dict = {}


def template_kernel(templates, template: str, **values):
    """The kernel function of one of a family's single-kernel templates rendered with `values`
    (a render.Templates), named after the template, the values and the family's templates digest
    (an edited template gets a new file), rendered and loaded once per process and mode."""
    key = (templates.folder, template, tuple(sorted(values.items())), interpreting())
    if key not in _TEMPLATE_KERNELS:
        text = f"{template}|{sorted(values.items())}|{templates.digest}"
        name = template.split(".")[0] + "_" + hashlib.sha256(text.encode()).hexdigest()[:12]
        _TEMPLATE_KERNELS[key] = getattr(load_source(name, templates.render(template, kernel_name=name, **values)),
                                         name)
    return _TEMPLATE_KERNELS[key]


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
    except (OSError, ValueError):  # missing, unreadable, or not UTF-8: written anew
        current = None
    if current != source:
        atomic_write(path, source)
    spec = importlib.util.spec_from_file_location(f"torch_xaccel_kernels.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # Triton resolves globals (_tanh) through the module
    spec.loader.exec_module(mod)
    _MODULES[(name, mode)] = mod
    return mod
