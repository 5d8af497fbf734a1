"""Pattern "group_norm": `group_norm` of a 2-D input [N, C] (a layer norm per group of channels,
as the xlstm package's MultiHeadLayerNorm applies it per head, on [B * S, NH * DH]), rewritten to
torch.ops.xaccel.group_norm. Group norms of [N, C, *] inputs (convolutional networks) are not this
pattern and stay as written, unreported.
"""
from __future__ import annotations

import torch
import torch.fx

from torch_xaccel.report import Fallback, Replacement

from .. import PassContext
from ..graph_utils import location, named_arguments, val

FAMILY = "group_norm"
aten = torch.ops.aten


def _refusal(x, weight, bias, groups) -> str | None:
    """Why a row group norm is left as written (reported), or None."""
    from torch_xaccel.codegen.group_norm import DTYPES, why_not

    xv = val(x)
    params = [val(t) for t in (weight, bias) if t is not None]
    if not xv.is_floating_point() or any(p.dtype != xv.dtype for p in params):
        return f"x {xv.dtype} with parameters {', '.join(str(p.dtype) for p in params) or 'none'}"
    if xv.device.type == "cuda":
        if xv.dtype not in DTYPES:
            return f"no group_norm kernel for {xv.dtype} (it would run its reference)"
        why = why_not(xv, *(val(t) if t is not None else None for t in (weight, bias)), groups)
        if why:
            return f"{why} (it would run its reference)"
    return None


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is aten.group_norm.default]:
        a = named_arguments(node)
        if a is None:
            continue
        x, groups, weight, bias, eps = a["input"], a["num_groups"], a["weight"], a["bias"], a["eps"]
        xv = val(x)
        fake_mode = getattr(xv, "fake_mode", None)
        if fake_mode is None or xv.dim() != 2 or not isinstance(groups, int) or not isinstance(eps, float):
            continue
        if not isinstance(xv.shape[1], int) or xv.shape[1] % groups:
            continue
        where = location(node)
        why = _refusal(x, weight, bias, groups)
        if why:
            ctx.report.fallbacks.append(Fallback(FAMILY, f"group norm of rows left as written: {why}", where))
            continue
        with graph.inserting_before(node):
            y = graph.call_function(torch.ops.xaccel.group_norm.default, (x, weight, bias, groups, eps))
            with fake_mode:
                y.meta["val"] = torch.ops.xaccel.group_norm.default(
                    xv, *(val(t) if t is not None else None for t in (weight, bias)), groups, eps)
        y.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        ctx.report.replacements.append(Replacement(
            FAMILY, "xaccel.group_norm", f"group norm of rows: {xv.shape[1]} channels in {groups} groups", where))
