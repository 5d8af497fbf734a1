"""Graph passes: normalize a Dynamo graph to ATen (normalize.py), then run each enabled family's
passes (lowering/<family>/, in families.PASS_ORDER) that rewrite matches to torch.ops.xaccel.*
calls. Installed as torch_xaccel.lowering."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from torch_xaccel import families
from torch_xaccel.config import Config
from torch_xaccel.report import GraphReport


@dataclass(frozen=True)
class PassContext:
    """What every pass receives: the compile's config, the graph's report (replacements and
    fallbacks go there) and whether the graph trains (some input requires grad under grad
    mode; the pre-dispatch graph's fake values do not carry requires_grad, so the backend
    decides it from the real inputs). A pass that needs the graph's Python-float inputs as
    constants (an eps under dynamic=True) adds CONSTANT_FLOATS to `requests`: the backend then has
    Dynamo specialize them and trace again."""
    config: Config
    report: GraphReport
    training: bool = False
    requests: set = field(default_factory=set)


CONSTANT_FLOATS = "constant floats"


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    for pattern, path in families.ordered_passes():
        if pattern in ctx.config.patterns:
            families.resolve(path)(gm, ctx)
    for family in families.FAMILIES:
        if ctx.config.patterns & set(family.patterns):
            for path in family.after_passes:
                families.resolve(path)(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return gm
