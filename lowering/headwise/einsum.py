"""Pattern "headwise": an einsum that applies one small linear map per head, rewritten to
torch.ops.xaccel.headwise.

Found by the equation's structure, whatever its letters and order: two operands, one of them (the
weight) with exactly three labels and no ellipsis,

    h: in both operands and the output (the head)
    d: in both operands, not the output (summed)
    o: in the weight and the output only
    every other label of x (and x's ellipsis): in the output (batch dims)

e.g. the xlstm package's LinearHeadwiseExpand, `einsum("...hd,hod->...ho", x, w)`, or
`einsum("bshd,hdo->bsho", ...)`. x is permuted to [batch..., H, D] and w to [H, DO, D] (views), and
the op's [batch..., H, DO] permuted to the equation's output order. Blocks larger than the kernel's
(codegen.headwise.MAX_BLOCK) are GEMMs that cuBLAS runs well: those stay as written, unreported.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from torch_xaccel.report import Fallback, Replacement

from .. import PassContext
from ..graph_utils import location, val

FAMILY = "headwise"
aten = torch.ops.aten


class _Plan:
    def __init__(self, x, w, x_perm, w_perm, out_perm, H, D, DO):
        self.x, self.w, self.x_perm, self.w_perm, self.out_perm = x, w, x_perm, w_perm, out_perm
        self.H, self.D, self.DO = H, D, DO


def _labels(spec: str, rank: int) -> list[str] | None:
    """One label per dim; an ellipsis becomes labels '.0', '.1', ... (None: the spec does not fit the rank)."""
    if spec.count("...") > 1:
        return None
    if "..." in spec:
        head, tail = spec.split("...")
        n = rank - len(head) - len(tail)
        return None if n < 0 else list(head) + [f".{i}" for i in range(n)] + list(tail)
    return list(spec) if len(spec) == rank else None


def _output_labels(spec: str, ellipsis: list[str]) -> list[str] | None:
    if spec.count("...") > 1:
        return None
    if "..." in spec:
        head, tail = spec.split("...")
        return list(head) + ellipsis + list(tail)
    return list(spec)


def _hint(size) -> int | None:
    """A size as an int: its value, or a symbolic size's example value (None: unbacked). The pass
    decides only what runs faster by it (block sizes); the op is exact at any size."""
    return size if isinstance(size, int) else getattr(size.node, "hint", None)


def plans(node: torch.fx.Node) -> list[_Plan]:
    """The rewrites of an einsum node: one per operand that can be read as the weight (either may,
    when both have three labels), none where its equation is not a per-head linear map."""
    if len(node.args) < 2 or not isinstance(node.args[0], str) or len(node.args[1]) != 2:
        return []
    equation = node.args[0].replace(" ", "")
    if "->" not in equation:
        return []
    lhs, out_spec = equation.split("->")
    specs = lhs.split(",")
    operands = list(node.args[1])
    if len(specs) != 2 or not all(isinstance(val(t), torch.Tensor) for t in operands):
        return []
    found = []
    for xi, wi in ((0, 1), (1, 0)):
        x, w = operands[xi], operands[wi]
        lx, lw = _labels(specs[xi], val(x).dim()), _labels(specs[wi], val(w).dim())
        if lx is None or lw is None or len(lw) != 3 or "..." in specs[wi]:
            continue
        lo = _output_labels(out_spec, [label for label in lx if label.startswith(".")])
        if lo is None or any(len(set(ls)) != len(ls) for ls in (lx, lw, lo)):
            continue
        sx, sw, so = set(lx), set(lw), set(lo)
        heads, summed, outs = sw & sx & so, (sw & sx) - so, (sw & so) - sx
        batch = sx - sw
        if len(heads) != 1 or len(summed) != 1 or len(outs) != 1 or not batch <= so or so != batch | heads | outs:
            continue
        (h,), (d,), (o,) = heads, summed, outs
        order = [label for label in lo if label in batch] + [h, o]
        H, D, DO = (val(w).shape[lw.index(c)] for c in (h, d, o))
        if None in map(_hint, (H, D, DO)) or not (statically_known_true(val(x).shape[lx.index(h)] == H)
                                     and statically_known_true(val(x).shape[lx.index(d)] == D)):
            continue
        found.append(_Plan(x, w, [lx.index(c) for c in order[:-1]] + [lx.index(d)],
                           [lw.index(h), lw.index(o), lw.index(d)], [order.index(c) for c in lo], H, D, DO))
    return found


def _permuted(graph, node, perm):
    if perm == list(range(len(perm))):
        return node
    out = graph.call_function(aten.permute.default, (node, perm))
    out.meta["val"] = val(node).permute(perm)
    return out


def _large(p: _Plan) -> bool:
    """Blocks the kernel leaves to cuBLAS (GEMMs): not this pattern, so not reported."""
    from torch_xaccel.codegen.headwise import MAX_BLOCK

    return _hint(p.D) > MAX_BLOCK or _hint(p.DO) > MAX_BLOCK


def _refusal(p: _Plan) -> str | None:
    """Why a per-head map with small blocks is left as written (reported), or None."""
    from torch_xaccel.codegen.headwise import DTYPES

    x, w = val(p.x), val(p.w)
    if not (x.is_floating_point() and w.dtype == x.dtype):
        return f"operands {x.dtype} x {w.dtype}"
    if x.device.type == "cuda" and x.dtype not in DTYPES:
        return f"no headwise kernel for {x.dtype} (it would run its reference)"
    return None


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is aten.einsum.default]:
        p = next((p for p in plans(node) if not _large(p)), None)
        fake_mode = getattr(val(p.x), "fake_mode", None) if p is not None else None
        if fake_mode is None:
            continue
        where = location(node)
        why = _refusal(p)
        if why:
            ctx.report.fallbacks.append(Fallback(FAMILY, f"headwise einsum '{node.args[0]}' left as written: {why}",
                                                 where))
            continue
        with graph.inserting_before(node):
            x, w = _permuted(graph, p.x, p.x_perm), _permuted(graph, p.w, p.w_perm)
            y = graph.call_function(torch.ops.xaccel.headwise.default, (x, w))
            with fake_mode:
                y.meta["val"] = torch.ops.xaccel.headwise.default(val(x), val(w))
            out = _permuted(graph, y, p.out_perm)
        for n in {x, w, y, out} - {p.x, p.w}:
            n.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        ctx.report.replacements.append(Replacement(
            FAMILY, "xaccel.headwise", f"einsum '{node.args[0]}': {p.H} heads of {p.D} x {p.DO}", where))
