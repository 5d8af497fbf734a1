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
from ..graph_utils import location, val

FAMILY = "group_norm"
aten = torch.ops.aten


def _arguments(node):
    """(x, groups, weight, bias, eps) of a group_norm node."""
    a = list(node.args) + [None] * 6
    get = lambda i, name, default: node.kwargs.get(name, a[i] if a[i] is not None else default)  # noqa: E731
    return a[0], get(1, "num_groups", None), get(2, "weight", None), get(3, "bias", None), get(4, "eps", 1e-5)


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
        x, groups, weight, bias, eps = _arguments(node)
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
