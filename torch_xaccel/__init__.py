"""torch_xaccel: a torch.compile backend that runs mLSTM, sLSTM and GEMM + elementwise chains as
generated kernels.  Use it with `torch.compile(model, backend="xaccel")` (no import needed once
installed) and ask `torch_xaccel.explain(model, *inputs)` what it replaced and why not."""
from __future__ import annotations

__version__ = "0.1.0"


def _map_top_level_folders_in_a_checkout() -> None:
    """Installed, lowering/ and codegen/ live inside this package (a package-dir mapping). Run
    straight from a source checkout (no install), let the same names resolve to the top-level
    folders of the design card by searching the checkout root too."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if (importlib.util.find_spec(__name__ + ".lowering") is None
            and os.path.isfile(os.path.join(root, "lowering", "__init__.py"))):
        __path__.append(root)  # noqa: F821 - the package's own search path


_map_top_level_folders_in_a_checkout()

# after the search path is set (lowering and codegen resolve through it)
from . import ops  # noqa: E402, F401  (registers torch.ops.xaccel.*)
from .errors import XaccelConfigError, XaccelFallbackWarning  # noqa: E402
from .explain import explain  # noqa: E402
from .report import FAMILIES, Report, last_report  # noqa: E402

__all__ = ["explain", "Report", "FAMILIES", "last_report", "XaccelConfigError", "XaccelFallbackWarning"]


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
