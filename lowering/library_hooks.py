"""Trace hooks for library functions: install a family's `substitute_in_graph` handlers for the
library modules already imported, and right after the others are imported (importing the libraries
eagerly would cost seconds, and most users have only some of them)."""
from __future__ import annotations

import importlib.abc
import sys
from typing import Callable


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls install(module) right after one of `modules` is imported."""

    def __init__(self, modules: set[str], install: Callable):
        self.modules, self.install = modules, install

    def find_spec(self, name, path, target=None):
        if name not in self.modules:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _Chained(spec.loader, self.install)
                    return spec
        return None


class _Chained(importlib.abc.Loader):
    def __init__(self, inner, install: Callable):
        self._inner, self._install = inner, install

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._install(module)


def register(modules: set[str], install: Callable) -> None:
    """install() the modules already imported, and hook the import of the others; idempotent."""
    for mod in modules:
        if mod in sys.modules:
            install(sys.modules[mod])
    hooked = any(isinstance(f, AfterImport) and f.install is install for f in sys.meta_path)
    if not all(m in sys.modules for m in modules) and not hooked:
        sys.meta_path.insert(0, AfterImport(modules, install))
