"""torch_xaccel: a torch.compile backend that runs mLSTM, sLSTM and GEMM + elementwise chains as
generated kernels.  Use it with `torch.compile(model, backend="xaccel")` (no import needed once
installed) and ask `torch_xaccel.explain(model, *inputs)` what it replaced and why not."""
from __future__ import annotations

__version__ = "0.1.0"  # the one place the version is written: pyproject.toml reads it (a literal, read without import)


def _map_top_level_folders_in_a_checkout() -> None:
    """Installed from a wheel, lowering/, codegen/ and csrc/ live inside this package. In a source
    checkout (run from it, or installed editable) they are top-level folders beside it (the design
    card's layout): torch_xaccel.lowering and the others then come from this checkout's folders,
    whatever another editable install maps those names to, and nothing else of the checkout (its
    tests/) becomes part of the package."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folders = {name for name in ("lowering", "codegen", "csrc")
               if os.path.isfile(os.path.join(root, name, "__init__.py"))}
    if not folders:
        return

    class CheckoutFolders(importlib.abc.MetaPathFinder):
        def __init__(self):
            self.root = root

        def find_spec(self, fullname, path=None, target=None):
            parts = fullname.split(".")
            if len(parts) < 2 or parts[0] != __name__ or parts[1] not in folders:
                return None
            if len(parts) > 2:  # a module inside: found along its package's path (this checkout's)
                return importlib.machinery.PathFinder.find_spec(fullname, path)
            folder = os.path.join(self.root, parts[1])
            return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                          submodule_search_locations=[folder])

    if not any(type(f).__name__ == "CheckoutFolders" and getattr(f, "root", None) == root for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFolders())


_map_top_level_folders_in_a_checkout()

# after the search path is set (lowering and codegen resolve through it)
from . import logs  # noqa: E402

logs.register()  # TORCH_LOGS="xaccel" (logs.py)

from . import config, ops  # noqa: E402, F401  (ops registers torch.ops.xaccel.*; config: config.patch)
from .errors import XaccelConfigError, XaccelFallbackWarning  # noqa: E402
from .explain import explain  # noqa: E402
from .families import REPORT_KEYS  # noqa: E402  (the keys of Report.counts(), in order)
from .report import Report, last_report  # noqa: E402

__all__ = ["config", "explain", "Report", "REPORT_KEYS", "last_report", "XaccelConfigError", "XaccelFallbackWarning"]


def _register_without_entry_point() -> None:
    """When the package is importable but not installed (no entry point metadata), register the
    backend by hand. With an entry point, torch registers it on lookup; doing it here too would
    make that lookup fail with 'duplicate name'."""
    from importlib.metadata import entry_points

    if any(ep.name == "xaccel" for ep in entry_points(group="torch_dynamo_backends")):
        return
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    from .backend import xaccel_backend

    if "xaccel" not in _COMPILER_FNS:
        register_backend(xaccel_backend, name="xaccel")


_register_without_entry_point()
