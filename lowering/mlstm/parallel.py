"""Pattern family "mlstm": the stabilized parallel mLSTM, rewritten to one torch.ops.xaccel.mlstm.

Matched (ATen pre-dispatch, walking back from the output matmul):

    logf = logsigmoid(f);  Fc = cumsum(logf, -1)
    logD = causal_mask(Fc[..., :, None] - Fc[..., None, :] + i[..., None, :], -inf)
    m = amax(logD, -1, keepdim=True);  D = exp(logD - m)
    C = (q @ k^T * scale) * D               scale = 1/sqrt(DQK) on q k^T, on q or on k
    n = maximum(|sum(C, -1, keepdim=True)|, exp(-m))
    h = (C / (n + eps)) @ v

with the causal mask written as masked_fill(~tril(ones), -inf), masked_fill(triu(ones, 1), -inf)
or where(tril(ones), x, -inf), or a cached boolean buffer in those roles (value checked at compile
time and asserted at run time); gates [B, NH, S] or [B, NH, S, 1]; maximum, mul and add in either
argument order. Every step is checked (ops, dims, the -inf fill, the scale value, eps a constant);
each intermediate must have no user outside the pattern. The replaced graph computes the same
function (the op's semantics without an initial state are exactly this form) in fp32, so it
agrees with the original within rounding. Anything else that starts like an mLSTM (a logsigmoid
feeding a cumsum) is reported with the step that did not match.
"""
from __future__ import annotations

import math
import numbers
import operator

import torch
import torch.fx

from torch_xaccel.report import Fallback, Replacement

from .. import CONSTANT_FLOATS, PassContext
from ..graph_utils import REPORTED_REGION, location, val
from . import provenance, regions, substitutions
from .matching import DynamicEps, NoMatch, example_int, expect, is_op, kernel_refusal

FAMILY = "mlstm"
aten = torch.ops.aten
CHUNK = 64

def _skip_full_slices(node, take):
    """x[..., :] style no-op slices that indexing leaves in the graph."""
    while (is_op(node, aten.slice.Tensor) and len(node.args) <= 4
           and tuple(node.args[2:4]) in ((0, 9223372036854775807), (None, None))):
        take(node)
        node = node.args[0]
    return node


def _unsqueezed(node, dim: int, take):
    """The tensor that `node` is, unsqueezed at `dim` (negative, counted on the result)."""
    node = _skip_full_slices(node, take)
    expect(node, aten.unsqueeze.default, what=f"an unsqueeze at dim {dim}")
    rank = val(node).dim()
    if node.args[1] % rank != dim % rank:
        raise NoMatch(f"unsqueeze at dim {node.args[1]}, expected {dim}")
    take(node)
    return _skip_full_slices(node.args[0], take)


def _either(node, test):
    """(matched arg, other arg) for a binary node where `test` accepts one of its two args."""
    a, b = node.args[0], node.args[1]
    for x, y in ((a, b), (b, a)):
        try:
            return test(x), y
        except NoMatch:
            continue
    raise NoMatch(f"neither input of {node.name} matches")


def _dims(node, want) -> bool:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims)
    rank = val(node.args[0]).dim()
    return [d % rank for d in dims] == [w % rank for w in want]


def _causal_mask(mask, negate: bool, take, checks: list):
    """tril(ones(S, S)) (negate=False) or its complement ~tril / triu(ones, 1) (negate=True), built
    in the graph; or a cached boolean [S, S] buffer (a slice of a graph input), whose value the
    graph cannot show: it is appended to `checks` and verified at run time (_assert_causal)."""
    try:
        if negate:
            if is_op(mask, aten.bitwise_not.default, aten.logical_not.default):
                take(mask)
                return _causal_mask(mask.args[0], False, take, checks)
            if is_op(mask, aten.triu.default) and (mask.args[1] if len(mask.args) > 1 else 0) == 1:
                take(mask)
                take(expect(mask.args[0], aten.ones.default, what="ones() under triu"))
                return
            raise NoMatch("mask is not the complement of a causal mask")
        take(expect(mask, aten.tril.default, what="tril(ones) causal mask"))
        if (mask.args[1] if len(mask.args) > 1 else 0) != 0:
            raise NoMatch("tril with a diagonal offset")
        take(expect(mask.args[0], aten.ones.default, what="ones() under tril"))
    except NoMatch:
        root = _cached_mask(mask)
        if root is None:
            raise
        checks.append((mask, root, negate))


def _cached_mask(node):
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


def _cached_mask_refusal(root: torch.fx.Node, negate: bool, gm: torch.fx.GraphModule) -> str | None:
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
    want = ones.triu(1) if negate else ones.tril()
    if real.shape[0] != real.shape[1] or not torch.equal(real, want):
        return f"the cached mask {root.name} is not {'triu(ones, 1)' if negate else 'tril(ones)'} (not causal)"
    return None


def _as_sequence(graph: torch.fx.Graph, gate: torch.fx.Node, fake_mode) -> torch.fx.Node:
    """A [B, NH, S, 1] gate as the op's [B, NH, S] (a view); a [B, NH, S] gate as it is."""
    if val(gate).dim() == 3:
        return gate
    node = graph.call_function(aten.squeeze.dim, (gate, -1))
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = val(gate).squeeze(-1)
    return node


def _assert_causal(graph: torch.fx.Graph, mask: torch.fx.Node, negate: bool) -> None:
    """Insert: the cached mask equals tril(ones) (or triu(ones, 1) when it marks what to drop),
    else an error at run time, never a silently different result."""
    ones = graph.call_function(aten.ones_like.default, (mask,))
    ref = (graph.call_function(aten.triu.default, (ones, 1)) if negate
           else graph.call_function(aten.tril.default, (ones,)))
    same = graph.call_function(aten.all.default, (graph.call_function(aten.eq.Tensor, (mask, ref)),))
    graph.call_function(aten._assert_async.msg, (same, "xaccel: the cached mask the mLSTM was compiled with is "
                                                       "no longer causal (lower-triangular)"))


def _masked_logd(node, take, checks: list):
    """The unmasked log-decay matrix under a causal -inf mask."""
    node = _skip_full_slices(node, take)
    take(node)
    if is_op(node, aten.masked_fill.Scalar):
        if node.args[2] != float("-inf"):
            raise NoMatch("masked_fill value is not -inf")
        _causal_mask(node.args[1], True, take, checks)
        return node.args[0]
    if is_op(node, aten.where.ScalarOther, aten.where.self):
        other = node.args[2]
        if isinstance(other, torch.fx.Node):
            take(expect(other, aten.full.default, aten.scalar_tensor.default, what="-inf fill"))
            other = other.args[-1]
        if other != float("-inf"):
            raise NoMatch("where fill value is not -inf")
        _causal_mask(node.args[0], False, take, checks)
        return node.args[1]
    raise NoMatch("no causal -inf mask on the log-decay matrix")


def _symbolic_equal(node, dk_size, power: float) -> bool:
    """A SymFloat node whose expression is exactly dk_size ** power, for every size."""
    import sympy

    v = val(node) if isinstance(node, torch.fx.Node) else None
    expr = getattr(getattr(v, "node", None), "expr", None)
    dk_expr = getattr(getattr(dk_size, "node", None), "expr", dk_size)
    if expr is None:
        return False
    # torch wraps float math in its own sympy functions; map the ones a scale uses to plain sympy
    plain = {"OpaqueUnaryFn_sqrt": lambda a: sympy.sqrt(a), "ToFloat": lambda a: a,
             "FloatPow": lambda a, b: a ** b, "FloatTrueDiv": lambda a, b: a / b, "PowByNatural": lambda a, b: a ** b}
    for name, fn in plain.items():
        expr = expr.replace(lambda e, n=name: type(e).__name__ == n, lambda e, f=fn: f(*e.args))
    try:
        return sympy.simplify(expr - sympy.Pow(dk_expr, sympy.Rational(power).limit_denominator(4))) == 0
    except (TypeError, ValueError):
        return False


def _scale_value(s, dk_size):
    """True when `s` (a number, or a symbolic expression of the head-dim size) is 1/sqrt(DQK)."""
    if isinstance(s, torch.fx.Node):
        return _symbolic_equal(s, dk_size, -0.5)
    dk = example_int(dk_size)
    return isinstance(s, numbers.Number) and dk is not None and math.isclose(float(s), dk ** -0.5, rel_tol=1e-6)


def _scale_divisor(s, dk_size) -> bool:
    """True when dividing by `s` (a number or sqrt of the head-dim size) means multiplying by 1/sqrt(DQK)."""
    if isinstance(s, numbers.Number):
        dk = example_int(dk_size)
        return dk is not None and math.isclose(float(s), dk ** 0.5, rel_tol=1e-6)
    if isinstance(s, torch.fx.Node):
        return _symbolic_equal(s, dk_size, 0.5)
    return False


def _strip_scale(node, dk_size):
    """(node without a 1/sqrt(DQK) factor, whether one was removed)."""
    if is_op(node, aten.div.Tensor) and _scale_divisor(node.args[1], dk_size):
        return node.args[0], True
    if is_op(node, aten.mul.Tensor):
        for x, y in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            if _scale_value(y, dk_size):
                return x, True
    return node, False


def _gate_column(node, take):
    """A gate as a column [B, NH, S, 1]: x[..., :, None] of a [B, NH, S] gate, or a [B, NH, S, 1]
    gate as it is. Returns the gate."""
    t = val(node)
    if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[-1] == 1 and not is_op(node, aten.unsqueeze.default):
        return node
    return _unsqueezed(node, -1, take)


def _gate_row(node, take):
    """A gate as a row [B, NH, 1, S]: x[..., None, :] of a [B, NH, S] gate, or the transpose of a
    [B, NH, S, 1] gate. Returns the gate."""
    node = _skip_full_slices(node, take)
    if is_op(node, aten.transpose.int, aten.permute.default):
        try:
            g = _transposed(node)
        except NoMatch:
            g = None
        t = val(g) if g is not None else None
        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[-1] == 1:
            take(node)
            return g
    return _unsqueezed(node, -2, take)


def _transposed(node):
    if is_op(node, aten.transpose.int) and {d % 4 for d in node.args[1:3]} == {2, 3}:
        return node.args[0]
    if is_op(node, aten.permute.default) and list(node.args[1]) in ([0, 1, 3, 2], [-4, -3, -1, -2]):
        return node.args[0]
    raise NoMatch("k is not transposed in its last two dims")


def match(h: torch.fx.Node):
    """Walk back from a candidate output matmul; return (inputs dict, eps, pattern nodes, cached
    masks to check as (mask node, the graph input it slices, negated)). A NoMatch carries
    `.depth`, how many pattern nodes held before the failing step."""
    seen: list[torch.fx.Node] = []
    checks: list = []
    try:
        return (*_match(h, seen, checks), checks)
    except NoMatch as e:
        e.depth = len(seen)
        raise


def _match(h: torch.fx.Node, seen: list, checks: list):

    def take(n):
        seen.append(n)
        return n

    expect(h, aten.matmul.default, what="the output matmul")
    take(h)
    x, v = h.args[0], h.args[1]
    div = take(expect(x, aten.div.Tensor, what="C / (n + eps)"))
    C, den = div.args[0], div.args[1]
    add = take(expect(den, aten.add.Tensor, what="n + eps"))
    (n, eps) = (add.args[0], add.args[1]) if isinstance(add.args[0], torch.fx.Node) else (add.args[1], add.args[0])
    if not isinstance(eps, numbers.Number):
        raise DynamicEps()
    mx = take(expect(n, aten.maximum.default, what="maximum(|sum C|, exp(-m))"))

    def abs_sum(node):
        a = expect(node, aten.abs.default, what="abs")
        s = expect(a.args[0], aten.sum.dim_IntList, what="sum over the last dim")
        if s.args[0] is not C or not _dims(s, [-1]) or not (s.args[2] if len(s.args) > 2 else s.kwargs.get("keepdim")):
            raise NoMatch("normalizer is not |C.sum(-1, keepdim=True)|")
        return a, s

    (a, s), e = _either(mx, abs_sum)
    take(a), take(s)
    take(expect(e, aten.exp.default, what="exp(-m)"))
    neg = take(expect(e.args[0], aten.neg.default, what="-m"))
    m = neg.args[0]
    mul = take(expect(C, aten.mul.Tensor, what="C = qk * D"))

    def decay(node):
        ex = expect(node, aten.exp.default, what="D = exp(logD - m)")
        sub = expect(ex.args[0], aten.sub.Tensor, what="logD - m")
        if sub.args[1] is not m:
            raise NoMatch("D is not stabilized by the same m")
        return ex, sub

    (ex, sub), qk = _either(mul, decay)
    take(ex), take(sub)
    logD = sub.args[0]
    amax = take(expect(m, aten.amax.default, what="m = amax(logD, -1, keepdim=True)"))
    if amax.args[0] is not logD or not _dims(amax, [-1]) or not (amax.args[2] if len(amax.args) > 2 else False):
        raise NoMatch("m is not logD.amax(-1, keepdim=True)")
    raw = _masked_logd(logD, take, checks)
    plus_i = take(expect(raw, aten.add.Tensor, what="pairwise gate sums + i"))

    def pairwise(node):
        d = expect(node, aten.sub.Tensor, what="Fc[:, None] - Fc[None, :]")
        views: list = []
        a0 = _gate_column(d.args[0], views.append)
        a1 = _gate_row(d.args[1], views.append)
        if a0 is not a1:
            raise NoMatch("pairwise difference of two different cumsums")
        return d, a0, views

    (d, Fc, views), igate = _either(plus_i, pairwise)
    take(d)
    for n in views:
        take(n)
    i = _gate_row(igate, take)
    cs = take(expect(Fc, aten.cumsum.default, what="cumsum of logsigmoid(f)"))
    seq_dim = val(cs).dim() - (2 if val(cs).dim() == 4 else 1)  # [B, NH, S] or [B, NH, S, 1] gates
    if cs.args[1] % val(cs).dim() != seq_dim:
        raise NoMatch("cumsum not over the sequence dim")
    ls = take(expect(cs.args[0], aten.log_sigmoid.default, what="logsigmoid(f)"))
    f = ls.args[0]
    # q k^T with exactly one 1/sqrt(DQK): on the product, on q or on k
    mm, scaled = qk, False
    if not is_op(qk, aten.matmul.default):
        inner = ([a for a in qk.args[:2] if is_op(a, aten.matmul.default)]
                 if is_op(qk, aten.div.Tensor, aten.mul.Tensor) else [])
        if not inner:
            raise NoMatch("expected q @ k^T, optionally scaled")
        stripped, scaled = _strip_scale(qk, val(inner[0].args[0]).shape[-1])
        if not scaled or stripped is not inner[0]:
            raise NoMatch("q k^T is scaled by something other than 1/sqrt(DQK)")
        take(qk)
        mm = inner[0]
    take(mm)
    qn, kt = mm.args[0], mm.args[1]
    dk = val(qn).shape[-1]
    if not scaled:
        qn2, scaled = _strip_scale(qn, dk)
        if scaled:
            take(qn)
            qn = qn2
    k = _transposed(kt)
    take(kt)
    if not scaled:
        k2, scaled = _strip_scale(k, dk)
        if scaled:
            take(k)
            k = k2
    if not scaled:
        raise NoMatch("no 1/sqrt(DQK) scale on q k^T")
    q = qn
    inputs = dict(q=q, k=k, v=v, i=i, f=f)
    for name, node in inputs.items():
        t = val(node)
        want = (4,) if name in "qkv" else (3, 4)  # gates [B, NH, S] or [B, NH, S, 1]
        if (not isinstance(t, torch.Tensor) or t.dim() not in want or not t.dtype.is_floating_point
                or (name in "if" and t.dim() == 4 and t.shape[-1] != 1)):
            raise NoMatch(f"{name} is not a {'4-D' if name in 'qkv' else '[B, NH, S] or [B, NH, S, 1]'} float tensor")
    if val(q).dtype != val(k).dtype or val(q).dtype != val(v).dtype:
        raise NoMatch("q, k, v dtypes differ")
    return inputs, float(eps), seen


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
    for h in [n for n in graph.nodes if is_op(n, aten.matmul.default)]:
        if h in gone:
            continue
        try:
            inputs, eps, nodes, mask_checks = match(h)
        except NoMatch as e:
            if isinstance(e, DynamicEps):
                ctx.requests.add(CONSTANT_FLOATS)
            misses[h] = (e.depth, str(e))
            continue
        region = set(nodes) - set(inputs.values())
        escaped = [n.name for n in region if n is not h and any(u not in region for u in n.users)]
        refusals = [r for r in (_cached_mask_refusal(root, neg, gm) for _, root, neg in mask_checks) if r]
        slower = kernel_refusal(*(val(inputs[x]) for x in "qkv"))
        why = (f"intermediates used elsewhere: {', '.join(escaped[:3])}" if escaped
               else "output dtype differs from q's" if val(h).dtype != val(inputs["q"]).dtype
               else f"{refusals[0]}: left as written" if refusals
               else f"left as written: {slower}; the op's reference would run instead, slower than this code" if slower
               else None)
        if why:
            misses[h] = (len(nodes), why)
            continue
        _replace(gm, h, inputs, eps, region, mask_checks, gone)
        report.replacements.append(Replacement(FAMILY, "xaccel.mlstm", "parallel stabilized form", location(h)))
    return {h: m for h, m in misses.items() if h not in gone}


def _replace(gm, h, inputs, eps, region, mask_checks, gone: set) -> None:
    graph = gm.graph
    fake_mode = getattr(val(inputs["q"]), "fake_mode", None)
    with graph.inserting_before(h):
        for mask, _, negate in mask_checks:
            _assert_causal(graph, mask, negate)
        gates = [_as_sequence(graph, inputs[g], fake_mode) for g in "if"]
        args = (inputs["q"], inputs["k"], inputs["v"], *gates, None, None, None, eps, CHUNK)
        fused = graph.call_function(torch.ops.xaccel.mlstm.default, args)
        out = graph.call_function(operator.getitem, (fused, 0))
    if fake_mode is not None:
        with fake_mode:
            fakes = torch.ops.xaccel.mlstm.default(*[val(a) if isinstance(a, torch.fx.Node) else a for a in args])
        fused.meta["val"], out.meta["val"] = fakes, fakes[0].to(val(h).dtype)
    if h.meta.get("stack_trace"):
        out.meta["stack_trace"] = h.meta["stack_trace"]
    h.replace_all_uses_with(out)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(region, key=order.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)
            gone.add(n)
