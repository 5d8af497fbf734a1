"""Pattern "causal_conv": a causal depthwise convolution over positions, rewritten to
torch.ops.xaccel.causal_conv1d.

A `conv1d` (or `convolution`) of x [B, C, S] with w [C, 1, K], groups == C, stride and dilation
1, in either of the two forms causal code takes:

    conv1d(x, w, b, padding=K - 1, groups=C)[..., :S]          (the xlstm package's CausalConv1d;
                                                                 the cut as :S or :-(K - 1))
    conv1d(pad(x, (K - 1, 0)), w, b, groups=C)                 (Mamba-style code)

Every user of the convolution must be that cut in the first form. Other convolutions are not this
pattern and stay as written, unreported.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from torch_xaccel.report import Fallback, Replacement

from .. import PassContext
from ..graph_utils import location, named_arguments, val

FAMILY = "causal_conv"
aten = torch.ops.aten
_CONVS = (aten.conv1d.default, aten.convolution.default)
_PADS = (aten.constant_pad_nd.default, aten.pad.default)


class _Match:
    def __init__(self, x, w, bias, K, outputs):
        self.x, self.w, self.bias, self.K, self.outputs = x, w, bias, K, outputs  # outputs: nodes y replaces


def _size(a):
    """A size argument's value: an int, or a symbolic size's SymInt (an FX node's example value)."""
    return val(a) if isinstance(a, torch.fx.Node) else a


def _sizes(v, n: int = 1) -> list | None:
    """An int or int-list argument (SymInts too) as a list of n (None: not sizes)."""
    v = _size(v)
    if isinstance(v, (int, torch.SymInt)):
        v = [v] * n
    elif isinstance(v, (list, tuple)):
        v = [_size(i) for i in v]
    else:
        return None
    return v if all(isinstance(i, (int, torch.SymInt)) for i in v) else None


def _equal(a, b) -> bool:
    """a == b for every value the sizes may take (dynamic shapes included), with no new guard."""
    a = _size(a)
    return isinstance(a, (int, torch.SymInt)) and statically_known_true(a == b)


def _all_equal(sizes, want: list) -> bool:
    return sizes is not None and len(sizes) == len(want) and all(_equal(a, b) for a, b in zip(sizes, want))


def _is_cut(user, S, K) -> bool:
    """user == conv[..., :S] (a slice of the last dim from 0 to S, or to -(K - 1))."""
    if user.op != "call_function" or user.target is not aten.slice.Tensor:
        return False
    a = named_arguments(user)
    if a is None or a["dim"] not in (2, -1) or a["start"] not in (0, None) or a["step"] != 1 or a["end"] is None:
        return False
    return _equal(a["end"], -(K - 1)) or _equal(a["end"], S)


def match(node) -> _Match | None:
    a = named_arguments(node)
    if a is None or a.get("transposed"):
        return None
    x, w, bias, padding = a["input"], a["weight"], a["bias"], a["padding"]
    xv, wv = val(x), val(w)
    if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor)) or xv.dim() != 3 or wv.dim() != 3:
        return None
    C, one, K = wv.shape
    if not (_equal(one, 1) and statically_known_true(K >= 2) and _equal(a["groups"], C) and _equal(xv.shape[1], C)):
        return None
    if isinstance(padding, str) or not (_all_equal(_sizes(a["stride"]), [1])
                                        and _all_equal(_sizes(a["dilation"]), [1])):
        return None
    S = xv.shape[2]
    if _all_equal(_sizes(padding), [K - 1]):
        users = list(node.users)
        if users and all(_is_cut(u, S, K) for u in users):
            return _Match(x, w, bias, K, users)
        return None
    if _all_equal(_sizes(padding), [0]) and x.op == "call_function" and x.target in _PADS:
        p = named_arguments(x)
        if p is not None and _all_equal(_sizes(p["pad"], 2), [K - 1, 0]) and p.get("mode", "constant") == "constant" \
                and p["value"] in (0, 0.0, None):
            return _Match(p["input"], w, bias, K, [node])
    return None


_STRIDED_VIEWS = (aten.transpose.int, aten.permute.default, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default,
                  aten.squeeze.dim, aten.squeeze.default, aten.expand.default, aten.alias.default, aten.t.default)
_LAYOUT_BOUND = (aten.view.default, aten._unsafe_view.default, aten.as_strided.default)


def _reads_layout(node, depth: int = 4) -> bool:
    """Whether a user of node, directly or through strided views, is an op whose result depends
    on node's strides (a `view` that the original layout allowed may not be allowed on the op's
    channels-innermost output)."""
    for user in node.users:
        if user.op != "call_function":
            continue
        if user.target in _LAYOUT_BOUND:
            return True
        if user.target in _STRIDED_VIEWS and depth and _reads_layout(user, depth - 1):
            return True
    return False


def _refusal(m: _Match) -> str | None:
    """Why a causal depthwise convolution is left as written (reported), or None."""
    from torch_xaccel.codegen.causal_conv import why_not

    x, w, b = val(m.x), val(m.w), val(m.bias) if m.bias is not None else None
    if not x.is_floating_point():
        return f"x is {x.dtype}"
    if x.device.type == "cuda":
        why = why_not(x, w.squeeze(1), b)
        if why:
            return f"{why} (it would run its reference)"
    return None


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _CONVS]:
        m = match(node)
        fake_mode = getattr(val(m.x), "fake_mode", None) if m is not None else None
        if fake_mode is None:
            continue
        where = location(node)
        why = _refusal(m)
        if why:
            ctx.report.fallbacks.append(Fallback(FAMILY, f"causal depthwise conv1d left as written: {why}", where))
            continue
        with graph.inserting_before(node):
            w = graph.call_function(aten.squeeze.dim, (m.w, 1))
            w.meta["val"] = val(m.w).squeeze(1)
            y = graph.call_function(torch.ops.xaccel.causal_conv1d.default, (m.x, w, m.bias))
            with fake_mode:
                y.meta["val"] = torch.ops.xaccel.causal_conv1d.default(val(m.x), val(w),
                                                                       val(m.bias) if m.bias is not None else None)
        result = y
        if any(_reads_layout(out) for out in m.outputs):  # a contiguous copy allows every view the original did
            with graph.inserting_after(y):
                result = graph.call_function(aten.clone.default, (y,), {"memory_format": torch.contiguous_format})
                result.meta["val"] = val(y).clone(memory_format=torch.contiguous_format)
        for n in {w, y, result}:
            n.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
        for out in m.outputs:
            out.replace_all_uses_with(result)
        for out in m.outputs:
            if out is not node:
                graph.erase_node(out)
        graph.erase_node(node)
        C = val(m.w).shape[0]
        ctx.report.replacements.append(Replacement(
            FAMILY, "xaccel.causal_conv1d", f"causal depthwise conv1d: {C} channels, kernel size {m.K}", where))
