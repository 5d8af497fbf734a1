"""The causal -inf mask of the parallel mLSTM, however the user builds it.

A mask is causal when it keeps exactly the positions s <= t of an [S, S] matrix. Three ways to
know, in this order:
1. built in the graph from sizes alone (tril(ones), triu(ones, 1), ~, == 0, arange comparisons,
   float masks cast to bool, ...) with static sizes: its value is computed at compile time
   (`constant_value`) and compared, whatever the spelling;
2. the same with symbolic sizes: the spellings tril(ones(S, S)), triu(ones(S, S), 1) and their
   complements, which are causal at every S;
3. a cached boolean buffer (a leading [:S, :S] slice of a graph input): its value in this
   compile's inputs is checked (`cached_refusal`) and asserted at run time (`assert_causal`).
"""
from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import proof
from ..graph_utils import val
from .matching import NoMatch, expect, is_op, skip_full_slices

aten = torch.ops.aten
MAX_CONSTANT_ELEMENTS = 1 << 26  # a mask evaluated at compile time: [8192, 8192] booleans at most
_PASS_THROUGH = (aten.lift_fresh_copy.default, aten.detach_.default, aten.detach.default, aten.alias.default,
                 aten.clone.default)


def constant_value(node) -> torch.Tensor | None:
    """The value of a tensor computed from constants alone (factories of static size, tensor
    constants, ops on them), evaluated now on the CPU; None where it reads a graph input, has a
    symbolic size, or is too large."""
    nodes = _constant_ancestry(node)
    if nodes is None:
        return None
    try:
        with unset_fake_temporarily(), torch.no_grad():
            gm, _ = proof.extract(nodes, [], outputs=[node])
            out = gm()[0]
    except Exception:  # noqa: BLE001 - a constant we cannot compute is one we do not know
        return None
    return out.cpu() if isinstance(out, torch.Tensor) else None


def _constant_ancestry(node) -> list | None:
    """`node` and what it is computed from, in graph order, if all of it is constant and static."""
    found, todo = {}, [node]
    while todo:
        n = todo.pop()
        if n in found:
            continue
        t = val(n)
        if n.op == "get_attr":
            found[n] = True
            continue
        if n.op != "call_function" or not isinstance(t, torch.Tensor) or t.numel() > MAX_CONSTANT_ELEMENTS \
                or any(not isinstance(s, int) for s in t.shape):
            return None
        if any(isinstance(a, torch.fx.Node) and not isinstance(val(a), torch.Tensor) for a in n.all_input_nodes):
            return None  # a symbolic size
        found[n] = True
        todo.extend(n.all_input_nodes)
    order = {n: k for k, n in enumerate(node.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def is_neg_inf(x) -> bool:
    """-inf as a number or as a constant tensor (torch.tensor(float("-inf")), full(-inf))."""
    if isinstance(x, (int, float)):
        return x == float("-inf")
    value = constant_value(x) if isinstance(x, torch.fx.Node) else None
    return value is not None and value.numel() > 0 and bool((value == float("-inf")).all())


def check(mask, drops: bool, take, checks: list) -> None:
    """Accept `mask` as causal: keeping s <= t (drops=False) or marking s > t to drop (drops=True);
    else NoMatch. A cached buffer goes to `checks` as (mask, the graph input, drops)."""
    value = constant_value(mask)
    if value is None:
        inner = _negation(mask)
        if inner is not None:
            take(mask)
            return check(inner[0], drops != inner[1], take, checks)
    if value is not None:
        if value.dim() != 2 or value.shape[0] != value.shape[1]:
            raise NoMatch("the -inf mask is not [S, S]")
        keep = torch.ones(value.shape, dtype=torch.bool).tril()
        if not torch.equal(value.bool(), ~keep if drops else keep):
            raise NoMatch("the -inf mask is not causal")
        for n in _constant_ancestry(mask):
            take(n)
        return None
    try:
        _symbolic(mask, drops, take)
    except NoMatch:
        root = _cached(mask)
        if root is None:
            raise
        checks.append((mask, root, drops))
    return None


# comparisons of a row index t with a column index s: which keep s <= t, which mark s > t
_KEEPS = {aten.ge.Tensor: "ts", aten.le.Tensor: "st"}
_DROPS = {aten.lt.Tensor: "ts", aten.gt.Tensor: "st"}


def _negation(mask) -> tuple | None:
    """(the mask under ~x, x == 0, x != 0 or a cast to bool, whether that negates it), else None."""
    if is_op(mask, aten.bitwise_not.default, aten.logical_not.default):
        return mask.args[0], True
    if is_op(mask, aten.eq.Scalar, aten.ne.Scalar) and mask.args[1] == 0:
        return mask.args[0], mask.target is aten.eq.Scalar
    if is_op(mask, aten._to_copy.default, aten.to.dtype) and val(mask).dtype == torch.bool:
        return mask.args[0], False
    return None


def _symbolic(mask, drops: bool, take) -> None:
    """tril(ones(S, S)) or an index comparison t >= s (drops=False), or the complement triu(ones,
    1) or t < s (drops=True): causal at every S, for masks of symbolic size."""
    if _index_comparison(mask, _DROPS if drops else _KEEPS, take):
        return None
    if drops:
        if is_op(mask, aten.triu.default) and (mask.args[1] if len(mask.args) > 1 else 0) == 1:
            take(mask)
            take(expect(mask.args[0], aten.ones.default, what="ones() under triu"))
            return None
        raise NoMatch("mask is not the complement of a causal mask")
    take(expect(mask, aten.tril.default, what="tril(ones) causal mask"))
    if (mask.args[1] if len(mask.args) > 1 else 0) != 0:
        raise NoMatch("tril with a diagonal offset")
    take(expect(mask.args[0], aten.ones.default, what="ones() under tril"))
    return None


def _index_comparison(mask, table: dict, take) -> bool:
    """mask = cmp(rows, cols) with rows arange(S)[:, None], cols arange(S)[None, :] (either order as
    `table` gives for cmp): True, its nodes taken."""
    if not is_op(mask, *table):
        return False
    args = mask.args[:2] if table[mask.target] == "ts" else mask.args[1::-1]
    views: list = []
    rows, cols = (_arange_along(a, dim, views.append) for a, dim in zip(args, (-1, 0)))
    if rows is None or cols is None or rows.args[0] != cols.args[0]:
        return False
    for n in (mask, *views, rows, cols):
        take(n)
    return True


def _arange_along(node, dim: int, view):
    """The arange(S) that `node` is, unsqueezed at `dim` (an index down rows: -1, across columns:
    0), through full slices (each passed to `view`)."""
    node = skip_full_slices(node, view)
    if not is_op(node, aten.unsqueeze.default) or node.args[1] % 2 != dim % 2:
        return None
    view(node)
    a = skip_full_slices(node.args[0], view)
    return a if is_op(a, aten.arange.default) and len(a.args) == 1 else None


def _cached(node):
    """The graph input (a registered buffer, a global) that `node` is a leading [:S, :S] slice
    of, if `node` is a boolean [S, S] tensor; else None. A leading square slice of a causal
    matrix is causal, so checking the whole input's value suffices."""
    t = val(node)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bool or t.dim() != 2:
        return None
    while is_op(node, aten.slice.Tensor, aten.alias.default, aten.detach.default):
        if is_op(node, aten.slice.Tensor) and (node.args[2:3] not in ((), (0,), (None,))
                                             or node.args[4:5] not in ((), (1,), (None,))):
            return None  # not a leading slice: start 0, step 1
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) and node.op == "placeholder" else None


def cached_refusal(root: torch.fx.Node, drops: bool, gm: torch.fx.GraphModule) -> str | None:
    """Why a cached mask cannot be used (None: it can): its value in this compile's real inputs
    must be tril(ones) (triu(ones, 1) when it marks what to drop); the run-time check then only
    guards against the buffer being changed afterwards."""
    inputs = gm.meta.get("xaccel_example_inputs")
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if inputs is None or len(inputs) != len(places):
        return "a cached mask whose value is unknown at compile time"
    real = inputs[places.index(root)]
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(real, torch.Tensor) or isinstance(real, FakeTensor) or real.dim() != 2 \
            or real.dtype != torch.bool:
        return "a cached mask whose value is unknown at compile time"
    ones = torch.ones_like(real)
    want = ones.triu(1) if drops else ones.tril()
    if real.shape[0] != real.shape[1] or not torch.equal(real, want):
        return f"the cached mask {root.name} is not {'triu(ones, 1)' if drops else 'tril(ones)'} (not causal)"
    return None


def assert_causal(graph: torch.fx.Graph, mask: torch.fx.Node, drops: bool) -> None:
    """Insert: the cached mask equals tril(ones) (or triu(ones, 1) when it marks what to drop),
    else an error at run time, never a silently different result."""
    ones = graph.call_function(aten.ones_like.default, (mask,))
    ref = (graph.call_function(aten.triu.default, (ones, 1)) if drops
           else graph.call_function(aten.tril.default, (ones,)))
    same = graph.call_function(aten.all.default, (graph.call_function(aten.eq.Tensor, (mask, ref)),))
    graph.call_function(aten._assert_async.msg, (same, "xaccel: the cached mask the mLSTM was compiled with is "
                                                       "no longer causal (lower-triangular)"))


def masked(node, take, checks: list):
    """(the tensor under a causal -inf mask, True) for where(keep, x, -inf), where(drop, -inf, x)
    or masked_fill(drop, -inf); (node, False) where `node` is no such mask. NoMatch where it is a
    -inf fill whose mask is not causal."""
    if is_op(node, aten.masked_fill.Scalar, aten.masked_fill.Tensor) and is_neg_inf(node.args[2]):
        take(node)
        _take_fill(node.args[2], take)
        check(node.args[1], True, take, checks)
        return node.args[0], True
    if is_op(node, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar):
        cond, a, b = node.args[:3]
        for x, fill, drops in ((a, b, False), (b, a, True)):
            if is_neg_inf(fill) and not is_neg_inf(x):
                take(node)
                _take_fill(fill, take)
                check(cond, drops, take, checks)
                return x, True
    return node, False


def _take_fill(fill, take) -> None:
    if isinstance(fill, torch.fx.Node):
        for n in _constant_ancestry(fill) or ():
            take(n)
