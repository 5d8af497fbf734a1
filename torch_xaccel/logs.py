"""torch_xaccel's logging, the torch way.

Every module logs under the `torch_xaccel` logger (children `torch_xaccel.<module>` follow it).
`register()` makes it one of torch._logging's logs under the name `xaccel`, so that

    TORCH_LOGS="xaccel"     shows INFO: each compiled graph's report and the measured choice's decisions
    TORCH_LOGS="+xaccel"    shows DEBUG too: the settings of each compile and where they came from
    torch._logging.set_logs(modules={"xaccel": logging.INFO})   does the same from Python

with torch's handler and format (and TORCH_LOGS_OUT). Without them nothing is shown (the logger
stays at Python's defaults, so logging.basicConfig(level=logging.INFO) shows it too).

torch parses TORCH_LOGS when it is imported, before torch_xaccel can register the name: there
the name `xaccel` only passes if the module `xaccel` can be found (torch then accepts it as a
module name and looks no further). On registration torch_xaccel takes the name over and has
torch parse TORCH_LOGS again, so the setting reaches the `torch_xaccel` logger.

XACCEL_LOG=1 (options={"xaccel.log": True}, config.patch(log=True)) is the one-switch
alternative: that compile's report and choice are logged at INFO even where the logger would
drop them, to stderr in torch's format.
"""
from __future__ import annotations

import logging
import os
import sys

NAME = "torch_xaccel"  # the logger's name: every torch_xaccel.* logger is its child
ALIAS = "xaccel"  # the name TORCH_LOGS and torch._logging.set_logs know it by

log = logging.getLogger(NAME)

_registered = False


def register() -> None:
    """Register the `xaccel` log with torch._logging (once); when TORCH_LOGS names it, apply
    TORCH_LOGS again now that torch knows the name. Best effort: torch's logging internals are
    private, and a torch where they moved only loses TORCH_LOGS="xaccel"."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        from torch._logging import _internal
    except ImportError:
        return
    try:
        _internal.register_log(ALIAS, NAME)
        if _names_us(os.environ.get(_internal.LOG_ENV_VAR, "")):
            _internal._parse_log_settings.cache_clear()  # (parsed before the name existed)
            _internal._init_logs()
    except Exception as e:  # noqa: BLE001 - logging must never break the import
        log.debug("torch_xaccel: could not register with torch._logging (%s: %s)", type(e).__name__, e)


def _names_us(settings: str) -> bool:
    names = {n.strip().lstrip("+-") for n in settings.split(",")}
    return ALIAS in names or NAME in names or any(n.startswith(NAME + ".") for n in names)


def info(msg: str, *args, force: bool = False) -> None:
    """log.info(msg, *args); with force (XACCEL_LOG), written to stderr even where the logger
    would drop INFO."""
    if log.isEnabledFor(logging.INFO):
        log.info(msg, *args, stacklevel=2)
    elif force:
        try:
            path, line, func, _ = log.findCaller(stacklevel=2)
        except (TypeError, ValueError):
            path, line, func = "(unknown file)", 0, None
        record = log.makeRecord(log.name, logging.INFO, path, line, msg, args, None, func)
        handler = logging.StreamHandler(sys.stderr)  # (made now: sys.stderr may have been replaced)
        handler.setFormatter(_formatter())
        handler.handle(record)


def _formatter() -> logging.Formatter:
    try:
        from torch._logging._internal import _default_formatter

        return _default_formatter()
    except Exception:  # noqa: BLE001 - torch's formatter moved: a plain one
        return logging.Formatter("%(levelname)s %(name)s: %(message)s")
