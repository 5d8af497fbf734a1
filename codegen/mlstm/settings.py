"""The mLSTM kernels' experiment switches: one frozen object, changed only for a block of code.

Each switch is on by default and selects the kernels as they ship; off, an older form the same
kernels keep for A/B timings (benchmarks/mlstm_sweep.py --scan-ab / --route-ab) and for tests that
check both forms agree:

    with settings.override(fused_route=False):
        ...

or, for a script that runs one form per process, settings.configure(fused_route=False).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelSettings:
    # time the candidate configs once per shape class (off: always the default config, for
    # benchmarks that time fixed configs themselves)
    tune: bool = True
    # the chunk-state scan reads each chunk's gate terms (log u per row, g and max log u per
    # chunk) from mlstm_chunk_gates, run in parallel first, instead of a logsigmoid, cumsum and
    # max in every tile at every sequential step
    chunk_scan_factors: bool = True
    # the reverse state-gradient scan reads r/N and r dden per row and g per chunk, written by
    # mlstm_bwd_rows, instead of recomputing them on its sequential path in every tile
    scan_row_factors: bool = True
    # the backward from kept chunk states reads each row's den and m_t, stored by the forward, in
    # mlstm_bwd_rows instead of recomputing q k^T there
    saved_rows: bool = True
    # the backward's last step (the eps term routed through the stabilizer max, the gates' final
    # gradients) in one kernel per row (mlstm_bwd_route) instead of a dozen torch launches
    fused_route: bool = True


_CURRENT = KernelSettings()


def current() -> KernelSettings:
    return _CURRENT


def configure(**changes) -> KernelSettings:
    """Change some switches for the rest of the process (names as in KernelSettings)."""
    global _CURRENT
    _CURRENT = dataclasses.replace(_CURRENT, **changes)
    return _CURRENT


@contextlib.contextmanager
def override(**changes):
    """Run a block with some switches changed (names as in KernelSettings)."""
    global _CURRENT
    before = _CURRENT
    _CURRENT = dataclasses.replace(before, **changes)
    try:
        yield _CURRENT
    finally:
        _CURRENT = before
