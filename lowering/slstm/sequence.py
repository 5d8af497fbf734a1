"""The `slstm` pattern's pass: sLSTM sequences become one xaccel::slstm.

Two sources: calls Dynamo traced from a library substitution (substitutions.py; reported here),
and hand-written loops over time steps that Dynamo unrolled (loops.py collapses them). Then an
all-zero initial state built in the graph becomes no initial state (zero_state.py)."""
from __future__ import annotations

import torch

from .. import PassContext
from . import loops, substitutions, zero_state


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    substitutions.report(gm, ctx)
    loops.collapse(gm, ctx)
    zero_state.run(gm)
