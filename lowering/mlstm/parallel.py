"""Pattern family "mlstm": mLSTM code rewritten to one torch.ops.xaccel.mlstm.

First the structural walk (parallel_form.py): each candidate h of the stabilized parallel form,
in any of the spellings it knows, whose every intermediate stays inside the form, becomes the op
with the user's eps (none: 0). The replaced graph computes the same function (the op's semantics
without an initial state are exactly this form) in fp32, so it agrees with the original within
rounding, at every length and with symbolic sizes. What the walk does not take goes to the
numeric proof (provenance.py) as a region grown from its log-sigmoids; a region refused there is
reported once, with the proof's reason and the walk's furthest step.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from torch_xaccel.report import Fallback, Replacement

from .. import CONSTANT_FLOATS, PassContext
from ..graph_utils import REPORTED_REGION, location, val
from . import causal_mask, provenance, regions, substitutions
from .matching import DynamicEps, NoMatch, kernel_refusal
from .parallel_form import match, product_operands

FAMILY = "mlstm"
aten = torch.ops.aten
CHUNK = 64


def _as_sequence(graph: torch.fx.Graph, gate: torch.fx.Node, fake_mode) -> torch.fx.Node:
    """A [B, NH, S, 1] gate as the op's [B, NH, S] (a view); a [B, NH, S] gate as it is."""
    if val(gate).dim() == 3:
        return gate
    node = graph.call_function(aten.squeeze.dim, (gate, -1))
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = val(gate).squeeze(-1)
    return node


def _candidates(graph: torch.fx.Graph) -> list:
    """Nodes that may be h: 4-D batched products (matmul, two-operand einsum)."""
    out = []
    for n in graph.nodes:
        try:
            product_operands(n, "h")
        except NoMatch:
            continue
        out.append(n)
    return out


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    report = ctx.report
    for node in gm.graph.nodes:  # calls Dynamo traced from substitutions.py
        if node.target is torch.ops.xaccel.mlstm.default and substitutions.traced_here(node):
            report.replacements.append(Replacement(FAMILY, "xaccel.mlstm", "mlstm_kernels native chunkwise "
                                                   "(substituted while Dynamo traced)", location(node)))
    misses = _parallel_forms(gm, ctx)
    # what the structural walk did not take: mLSTM-shaped regions, proven by running them
    for nodes, reason, where in provenance.run(gm, ctx, regions.seeds(gm.graph)):
        if reason is None:
            continue
        near = max((misses[h] for h in nodes if h in misses), default=None)
        also = f"; as the parallel form: {near[1]}" if near else ""
        report.fallbacks.append(Fallback(FAMILY, f"mLSTM-like code (a log-sigmoid of a gate) not replaced: {reason}"
                                                 f"{also}", where))
        for n in nodes:  # its matmuls are part of this one line, not GEMM fallbacks of their own
            n.meta[REPORTED_REGION] = FAMILY


def _parallel_forms(gm: torch.fx.GraphModule, ctx: PassContext) -> dict:
    """Replace each parallel stabilized form; {candidate matmul: (how far it matched, why not)}
    for the others (reported with the region around them, once)."""
    report, graph = ctx.report, gm.graph
    misses: dict = {}
    gone: set = set()
    constant = regions.Constants()
    for h in _candidates(graph):
        if h in gone:
            continue
        try:
            inputs, eps, nodes, mask_checks, layouts = match(h)
        except NoMatch as e:
            if isinstance(e, DynamicEps):
                ctx.requests.add(CONSTANT_FLOATS)
            misses[h] = (e.depth, str(e))
            continue
        region = set(nodes) - set(inputs.values())
        # a mask or -inf built once and shared by several layers is no escape: constants stay
        escaped = [n.name for n in region if n is not h and not constant(n) and any(u not in region for u in n.users)]
        refusals = [r for r in (causal_mask.cached_refusal(root, drops, gm) for _, root, drops in mask_checks) if r]
        slower = kernel_refusal(*(_permuted(val(inputs[x]), layouts.get(x)) for x in "qkv"))
        why = (f"intermediates used elsewhere: {', '.join(escaped[:3])}" if escaped
               else "output dtype differs from q's" if val(h).dtype != val(inputs["q"]).dtype
               else f"{refusals[0]}: left as written" if refusals
               else f"left as written: {slower}; the op's reference would run instead, slower than this code" if slower
               else None)
        if why:
            misses[h] = (len(nodes), why)
            continue
        _replace(gm, h, inputs, eps, region, mask_checks, layouts, gone)
        report.replacements.append(Replacement(FAMILY, "xaccel.mlstm", "parallel stabilized form", location(h)))
    return {h: m for h, m in misses.items() if h not in gone}


def _permuted(t, dims):
    return t if dims is None or not isinstance(t, torch.Tensor) else t.permute(dims)


def _laid_out(graph: torch.fx.Graph, node: torch.fx.Node, dims, fake_mode) -> torch.fx.Node:
    """node permuted by dims (an einsum's operand or result in its own layout), or node itself."""
    if dims is None:
        return node
    out = graph.call_function(aten.permute.default, (node, list(dims)))
    if fake_mode is not None:
        with fake_mode:
            out.meta["val"] = val(node).permute(dims)
    return out


def _replace(gm, h, inputs, eps, region, mask_checks, layouts: dict, gone: set) -> None:
    graph = gm.graph
    fake_mode = getattr(val(inputs["q"]), "fake_mode", None)
    with graph.inserting_before(h):
        for mask, _, drops in mask_checks:
            causal_mask.assert_causal(graph, mask, drops)
        gates = [_as_sequence(graph, inputs[g], fake_mode) for g in "if"]
        qkv = [_laid_out(graph, inputs[x], layouts.get(x), fake_mode) for x in "qkv"]
        args = (*qkv, *gates, None, None, None, eps, CHUNK)
        fused = graph.call_function(torch.ops.xaccel.mlstm.default, args)
        h_op = graph.call_function(operator.getitem, (fused, 0))
    if fake_mode is not None:
        with fake_mode:
            fakes = torch.ops.xaccel.mlstm.default(*[val(a) if isinstance(a, torch.fx.Node) else a for a in args])
        fused.meta["val"], h_op.meta["val"] = fakes, fakes[0].to(val(h).dtype)
    with graph.inserting_before(h):
        out = _laid_out(graph, h_op, layouts.get("h"), fake_mode)
    if h.meta.get("stack_trace"):
        out.meta["stack_trace"] = h.meta["stack_trace"]
    h.replace_all_uses_with(out)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(region, key=order.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)
            gone.add(n)
