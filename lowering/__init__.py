"""Graph passes: normalize a Dynamo graph to ATen, then match each family and rewrite it to
torch.ops.xaccel.* calls. Installed as torch_xaccel.lowering."""
from __future__ import annotations

from typing import Callable

import torch.fx

from . import gemm_epilogue, mlstm, mlstm_step

# family -> pass(gm, graph_report, training); order matters: larger patterns first once there are several.
PASSES: dict[str, Callable[[torch.fx.GraphModule, object, bool], None]] = {
    # mLSTM passes first (their regions hold matmuls the GEMM pass would otherwise take); the step
    # before the sequence form, so that steps it replaces are not reported as unrecognized mLSTMs
    "mlstm_step": mlstm_step.run,
    "mlstm": mlstm.run,
    "gemm_epilogue": gemm_epilogue.run,
}
FAMILIES_WITH_PASSES: tuple[str, ...] = tuple(PASSES)


def run_passes(gm: torch.fx.GraphModule, patterns, graph_report, training: bool = False) -> torch.fx.GraphModule:
    """training: some graph input requires grad under grad mode (the pre-dispatch graph's fake
    values do not carry requires_grad, so the backend decides this from the real inputs)."""
    for family, fn in PASSES.items():
        if family in patterns:
            fn(gm, graph_report, training)
    gm.graph.lint()
    gm.recompile()
    return gm
