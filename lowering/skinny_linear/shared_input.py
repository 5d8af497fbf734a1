"""Pattern "skinny_linear": linears with at most MAX_N outputs in all (gate projections: one
output per head) that read the same input, rewritten to one torch.ops.xaccel.skinny_linear with
their weights (and biases) stacked, each linear's output a slice of its result. Where the input
is a concatenation along the last dim (the xlstm package's `torch.cat([q, k, v], -1)`), the op
reads the parts in place and the concatenation goes when nothing else reads it.

What the op saves is structural: a read of the input shared by several linears, or the
concatenation never built. A lone linear of a plain input gains neither and is the gemm_epilogue
pass's (which fuses what follows it), as are linears with more outputs. On CUDA, a linear of fewer than
MIN_ROWS static rows (a decode step) stays on cuBLAS, reported.
"""
from __future__ import annotations

import torch
import torch.fx

from torch_xaccel.report import Fallback, Replacement

from .. import PassContext
from ..graph_utils import location, named_arguments, val

FAMILY = "skinny_linear"
aten = torch.ops.aten


def _narrow_linear(node, max_n: int):
    """(input, weight, bias) of a linear with at most max_n outputs and static sizes, else None."""
    if node.op != "call_function" or node.target is not aten.linear.default:
        return None
    a = named_arguments(node)
    if a is None or not isinstance(a["input"], torch.fx.Node) or not isinstance(a["weight"], torch.fx.Node):
        return None
    x, w = val(a["input"]), val(a["weight"])
    if getattr(x, "fake_mode", None) is None or w is None or w.dim() != 2 or x.dim() < 2:
        return None
    if not (isinstance(w.shape[0], int) and isinstance(w.shape[1], int)) or w.shape[0] > max_n:
        return None
    return a["input"], a["weight"], a["bias"]


def _parts(x: torch.fx.Node, max_inputs: int) -> list:
    """The tensors the op reads: a last-dim concatenation's parts, else x itself."""
    if x.op == "call_function" and x.target is aten.cat.default:
        a = named_arguments(x)
        parts, dim = a["tensors"], a["dim"]
        if 2 <= len(parts) <= max_inputs and dim in (-1, val(x).dim() - 1) and \
                all(isinstance(p, torch.fx.Node) and val(p).dim() == val(x).dim() for p in parts):
            return list(parts)
    return [x]


def _groups(linears: list, max_n: int, order: dict) -> list[list]:
    """Consecutive runs of linears whose outputs sum to at most max_n, each linear's weight and
    bias defined before the run's first linear (where the op goes)."""
    groups, width = [], max_n + 1
    for lin in linears:
        if groups and any(order[t] > order[groups[-1][0][0]] for t in lin[2:] if t is not None):
            width = max_n + 1
        n = val(lin[2]).shape[0]
        if width + n > max_n:
            groups.append([])
            width = 0
        groups[-1].append(lin)
        width += n
    return groups


def _refusal(xs, weight_vals, bias_vals) -> str | None:
    """Why these linears stay as written (reported), or None."""
    from torch_xaccel.codegen.skinny_linear import MIN_ROWS, why_not

    xv = [val(x) for x in xs]
    if not xv[0].is_floating_point():
        return f"{xv[0].dtype} input"
    if xv[0].device.type != "cuda":
        return None
    rows = 1
    for s in xv[0].shape[:-1]:
        rows *= s
    if isinstance(rows, int) and rows < MIN_ROWS:
        return f"{rows} rows (fewer than {MIN_ROWS}: cuBLAS runs it)"
    N, K = sum(w.shape[0] for w in weight_vals), weight_vals[0].shape[1]
    with xv[0].fake_mode:
        weight = xv[0].new_empty(N, K, dtype=weight_vals[0].dtype)
        bias = xv[0].new_empty(N, dtype=bias_vals[0].dtype) if bias_vals else None
    return why_not(weight, bias, xv)


def _stacked(graph, nodes: list) -> torch.fx.Node:
    """One tensor of the linears' weights (or biases) along dim 0."""
    if len(nodes) == 1:
        return nodes[0]
    out = graph.call_function(aten.cat.default, (nodes, 0))
    with val(nodes[0]).fake_mode:
        out.meta["val"] = torch.cat([val(n) for n in nodes], 0)
    return out


def _replace(graph, group: list, xs: list) -> None:
    """Insert the op before the group's first linear; each linear's uses read its slice."""
    nodes, weights = [g[0] for g in group], [g[2] for g in group]
    biases = [g[3] for g in group if g[3] is not None]
    fake_mode = val(xs[0]).fake_mode
    with graph.inserting_before(nodes[0]):
        weight = _stacked(graph, weights)
        bias = _stacked(graph, biases) if biases else None
        y = graph.call_function(torch.ops.xaccel.skinny_linear.default, (weight, bias, xs))
        with fake_mode:
            y.meta["val"] = torch.ops.xaccel.skinny_linear.default(
                val(weight), None if bias is None else val(bias), [val(x) for x in xs])
        y.meta.update({k: v for k, v in nodes[0].meta.items() if k in ("stack_trace", "nn_module_stack")})
        start = 0
        for node, w in zip(nodes, weights):
            n = val(w).shape[0]
            out = y
            if len(nodes) > 1:
                out = graph.call_function(aten.slice.Tensor, (y, -1, start, start + n))
                with fake_mode:
                    out.meta["val"] = aten.slice.Tensor(val(y), -1, start, start + n)
            start += n
            node.replace_all_uses_with(out)
    for node in nodes:
        graph.erase_node(node)


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    from torch_xaccel.codegen.skinny_linear import MAX_INPUTS, MAX_N

    graph = gm.graph
    by_input: dict = {}
    for node in list(graph.nodes):
        found = _narrow_linear(node, MAX_N)
        if found is not None:
            by_input.setdefault((found[0], found[2] is None), []).append(node)
    for nodes in by_input.values():
        # read afresh: an earlier group may have replaced this input (a linear's output) by a slice
        linears = [(node, *_narrow_linear(node, MAX_N)) for node in nodes]
        x = linears[0][1]
        xs = _parts(x, MAX_INPUTS)
        order = {n: i for i, n in enumerate(graph.nodes)}  # the graph as earlier groups left it
        for group in _groups(linears, MAX_N, order):
            if len(group) == 1 and len(xs) == 1:
                continue  # nothing shared, nothing to read in place
            where = location(group[0][0])
            what = (f"{len(group)} linear(s) of one input, {sum(val(g[2]).shape[0] for g in group)} outputs"
                    + (f", over the concatenation of {len(xs)} inputs read in place" if len(xs) > 1 else ""))
            why = _refusal(xs, [val(g[2]) for g in group], [val(g[3]) for g in group if g[3] is not None])
            if why:
                ctx.report.fallbacks.append(Fallback(FAMILY, f"{what} left as written: {why}", where))
                continue
            _replace(graph, group, xs)
            ctx.report.replacements.append(Replacement(FAMILY, "xaccel.skinny_linear", what, where))
        if x.target is aten.cat.default and not x.users:
            graph.erase_node(x)
