"""Exception and warning types the user can catch or filter."""
from __future__ import annotations


class XaccelConfigError(ValueError):
    """A setting holds a value the backend does not accept: an XACCEL_* environment variable,
    a torch_xaccel.config.patch(...) argument (raised at that call), or torch.compile's mode= /
    options= (raised at the compiled model's first call, which compiles it)."""


_AT_COMPILE: type | None = None


def at_compile(error: XaccelConfigError) -> XaccelConfigError:
    """`error` as raised from inside the backend, so that it reaches the caller of the compiled
    model as an XaccelConfigError (and a ValueError) instead of being wrapped.

    Dynamo wraps whatever a backend raises in torch._dynamo.exc.BackendCompilerFailed, except
    exceptions that already are one (a ShortenTraceback): those every layer between the backend
    and the user re-raises as they are (output_graph's call of the backend, symbolic_convert,
    convert_frame, eval_frame; torch 2.11 to 2.14). The error raised here is both: its type
    subclasses XaccelConfigError and BackendCompilerFailed, so `except XaccelConfigError`,
    `except ValueError` and torch's own `except BackendCompilerFailed` all catch it, and its
    message is Dynamo's usual "backend='xaccel' raised: XaccelConfigError: ...".
    The BackendCompilerFailed type is made here, on first use, so that importing torch_xaccel
    does not import Dynamo."""
    global _AT_COMPILE
    if _AT_COMPILE is None:
        from types import SimpleNamespace

        from torch._dynamo.exc import BackendCompilerFailed

        class XaccelConfigErrorAtCompile(XaccelConfigError, BackendCompilerFailed):
            """An XaccelConfigError found while the backend compiled a graph (see at_compile)."""

            def __init__(self, error: XaccelConfigError):
                # no frame to cut the traceback at: Dynamo's frames stay (a frame not in it would fail)
                BackendCompilerFailed.__init__(self, SimpleNamespace(__name__="xaccel"), error, None)

            def __reduce__(self):  # pickles (e.g. across processes) as the plain error
                return XaccelConfigError, (str(self.inner_exception),)

        XaccelConfigErrorAtCompile.__module__ = __name__
        XaccelConfigErrorAtCompile.__qualname__ = "XaccelConfigErrorAtCompile"
        _AT_COMPILE = XaccelConfigErrorAtCompile
    if isinstance(error, _AT_COMPILE):
        return error
    return _AT_COMPILE(error)


class XaccelFallbackWarning(UserWarning):
    """The backend could not do its work and ran the captured graph (or an op) without it."""
