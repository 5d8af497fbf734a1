"""The structural walk over the stabilized parallel mLSTM: `match` walks back from h and names its
inputs, its eps and every node of the form, or raises NoMatch with the step that did not hold.

    logf = logsigmoid(f);  Fc = cumsum(logf)
    logD = causal_mask(Fc[t] - Fc[s] + i[s], -inf)
    m = rowmax(logD);  D = exp(logD - m)
    C = (q k^T) * D * scale                 scale = 1/sqrt(DQK) in all, on q, k, q k^T or C
    n = maximum(|rowsum(C)|, exp(-m))
    h = (C / (n [+ eps])) @ v

Spellings taken, each step independently:
- products: @ (matmul) or a two-operand einsum (any letters; q, k, v and h in any layout, e.g.
  [B, S, NH, D] with the heads transpose inside the einsum; C in [B, NH, S, S]);
- the row maximum: amax(logD, -1, keepdim=True), or max(logD, -1, keepdim=True) by .values,
  [0] or tuple unpacking; maximum or max for the normalizer, arguments in either order;
- the eps: a constant added to the normalizer, or none (eps = 0: the op takes it exactly);
- the scale: any product of constants (or sqrt of the head dim) on q, k, their product or C;
- the mask: masked_fill or where (either branch), before or after adding i, with any causal mask
  causal_mask.check accepts; the -inf as a number or a constant tensor;
- the pairwise differences: Fc[..., :, None] - Fc[..., None, :] of [B, NH, S] gates, Fc - Fc^T
  of [B, NH, S, 1] gates, or the xlstm package's zero-padded cumsum repeated, subtracted from its
  transpose and cut to [1:, 1:];
- the log forget gate: logsigmoid(f), log(sigmoid(f)) or -softplus(-f).
"""
from __future__ import annotations

import math
import numbers
import operator

import torch
import torch.fx

from ..graph_utils import val
from . import causal_mask
from .matching import FULL_END, DynamicEps, NoMatch, expect, is_op, skip_full_slices

aten = torch.ops.aten


class Walk:
    """What a walk has taken: the form's nodes, its -inf masks, the cached masks to check at run
    time. `take` is the walk's one way to claim a node; an alternative that fails is undone
    (`attempt`)."""

    def __init__(self):
        self.seen: list = []
        self.masks: list = []
        self.checks: list = []
        # inputs laid out otherwise than [B, NH, S, D]: name -> the permute that makes them so;
        # "h": the permute of the op's [B, NH, S, DV] that is the user's h
        self.layouts: dict = {}

    def take(self, node):
        self.seen.append(node)
        return node

    def attempt(self, test, *args):
        sizes = len(self.seen), len(self.masks), len(self.checks)
        try:
            return test(*args)
        except NoMatch:
            del self.seen[sizes[0]:], self.masks[sizes[1]:], self.checks[sizes[2]:]
            raise


def match(h: torch.fx.Node):
    """Walk back from a candidate h; (inputs dict, eps, pattern nodes, cached masks to check as (mask
    node, the graph input it slices, drops), layouts: Walk.layouts). A NoMatch carries `.depth`,
    how many pattern nodes held before the failing step."""
    walk = Walk()
    try:
        inputs, eps = _match(h, walk)
    except NoMatch as e:
        e.depth = len(walk.seen)
        raise
    return inputs, eps, walk.seen, walk.checks, walk.layouts


def _match(h: torch.fx.Node, walk: Walk):
    take = walk.take
    p = product_operands(h, "h = (C / n) @ v")
    if p.a_dims != _SAME:
        raise NoMatch("the output product reads C transposed")
    x, v = p.a, p.b
    _lay_out(walk, "v", p.b_dims)  # [B, NH, S(contracted), DV]
    _lay_out(walk, "h", _inverse(p.out_dims))
    take(h)
    C, eps, m = _normalized(x, walk)
    (qk, scales), D = _factors_of_C(C, m, take)
    logD = _stabilized(D, m, take)
    Fc, i = _log_decay(logD, walk)
    f = _forget_gate(Fc, take)
    q, k = _scores(qk, scales, walk)
    inputs = dict(q=q, k=k, v=v, i=i, f=f)
    _check_inputs(inputs)
    return inputs, float(eps)


# ---- the products -------------------------------------------------------------------------------

_SAME = (0, 1, 2, 3)


class Product:
    """out[b1, b2, r, s] = sum_c a[b1, b2, r, c] b[b1, b2, c, s], each operand and the output held in
    some layout: `a_dims` are a's dims in the order (b1, b2, r, c), `b_dims` b's in the order (b1,
    b2, c, s), `out_dims` the output's in the order (b1, b2, r, s); a permute by them gives the
    canonical layout. (b1, b2) are the batch dims in the output's order."""

    def __init__(self, a, b, a_dims=_SAME, b_dims=_SAME, out_dims=_SAME):
        self.a, self.b, self.a_dims, self.b_dims, self.out_dims = a, b, tuple(a_dims), tuple(b_dims), tuple(out_dims)


def product_operands(node, what: str) -> Product:
    """A batched 4-D product written as matmul or as a two-operand einsum."""
    if is_op(node, aten.matmul.default):
        return Product(node.args[0], node.args[1])
    if not is_op(node, aten.einsum.default):
        raise NoMatch(f"expected {what}, found {getattr(node, 'target', node)}")
    equation, operands = node.args[0], node.args[1]
    if len(operands) != 2 or "." in equation or "->" not in equation:
        raise NoMatch(f"{what}: an einsum that is not a batched product")
    lhs, out = equation.replace(" ", "").split("->")
    a, b = lhs.split(",")
    batch = [x for x in out if x in a and x in b]
    contracted = [x for x in a if x in b and x not in out]
    rows, cols = [x for x in a if x not in b], [x for x in b if x not in a]
    if (not (len(a) == len(b) == len(out) == 4) or len(set(a + b + out)) != 5 or len(batch) != 2
            or len(contracted) != 1 or len(rows) != 1 or len(cols) != 1 or sorted(out) != sorted(batch + rows + cols)):
        raise NoMatch(f"{what}: an einsum that is not a batched product")
    (b1, b2), c, r, s = batch, contracted[0], rows[0], cols[0]
    return Product(operands[0], operands[1], [a.index(x) for x in (b1, b2, r, c)],
                   [b.index(x) for x in (b1, b2, c, s)], [out.index(x) for x in (b1, b2, r, s)])


def _inverse(dims: tuple) -> tuple:
    return tuple(sorted(range(len(dims)), key=dims.__getitem__))


def _lay_out(walk: "Walk", name: str, dims: tuple) -> None:
    if tuple(dims) != _SAME:
        walk.layouts[name] = tuple(dims)


def _scores(qk, scales: list, walk: "Walk") -> tuple:
    """(q, k) of q k^T times `scales` (the scalar factors on C). Scalar factors on q or k (used
    only there) count towards 1/sqrt(DQK) where those on C alone do not make it; otherwise they
    stay part of the inputs (a k * 0.5 the user scaled on purpose)."""
    p = product_operands(qk, "q @ k^T")
    if p.out_dims != _SAME:
        raise NoMatch("q k^T is not laid out [B, NH, S, S]")
    q, kt = p.a, p.b
    # k [B, NH, S, D]: for a matmul, its transpose is a node of its own; an einsum reads k as it is
    k_dims = (p.b_dims[0], p.b_dims[1], p.b_dims[3], p.b_dims[2])
    k_t = is_op(qk, aten.einsum.default)
    walk.take(qk)
    dk = val(q).shape[p.a_dims[3]]
    first = None
    for strip in ((False, False), (True, False), (False, True), (True, True)):
        try:
            found = walk.attempt(_scaled_scores, q, kt, k_t, strip, scales, dk, walk.take)
            _lay_out(walk, "q", p.a_dims)
            if k_t:
                _lay_out(walk, "k", k_dims)
            return found
        except NoMatch as e:
            first = first or e
    raise first


def _scaled_scores(q, kt, k_t: bool, strip: tuple, scales: list, dk, take) -> tuple:
    """(q, k) with the scalar factors `strip` says (on q, on k) counted in the scale, which must
    then be 1/sqrt(DQK); factors outside k's transpose always count (they scale the scores)."""
    strip_q, strip_k = strip
    found = list(scales)
    if strip_q:
        q, more = _strip_scalars(q, take)
        found += more or _nothing_to_strip()
    if not k_t:  # k^T as a tensor of its own: a transpose of k
        kt, more = _strip_scalars(kt, take)
        found += more
        take(kt)
        kt = _transposed(kt)
    k = kt
    if strip_k:
        k, more = _strip_scalars(k, take)
        found += more or _nothing_to_strip()
    _check_scale(found, dk)
    return q, k


def _nothing_to_strip():
    raise NoMatch("no scalar factor to count")


def _transposed(node):
    if is_op(node, aten.transpose.int) and {d % 4 for d in node.args[1:3]} == {2, 3}:
        return node.args[0]
    if is_op(node, aten.permute.default) and list(node.args[1]) in ([0, 1, 3, 2], [-4, -3, -1, -2]):
        return node.args[0]
    raise NoMatch("k is not transposed in its last two dims")


# ---- scalar factors --------------------------------------------------------------------------

def _is_scalar(a) -> bool:
    return isinstance(a, numbers.Number) or isinstance(a, torch.fx.Node) and isinstance(val(a), torch.SymFloat)


def _strip_scalars(node, take) -> tuple:
    """(node without scalar mul/div factors that only it reads, the factors as (value, power))."""
    scales = []
    while len(getattr(node, "users", ())) == 1:
        if is_op(node, aten.mul.Tensor) and any(_is_scalar(a) for a in node.args[:2]):
            s, rest = (node.args[0], node.args[1]) if _is_scalar(node.args[0]) else (node.args[1], node.args[0])
            scales.append((s, 1))
        elif is_op(node, aten.div.Tensor) and _is_scalar(node.args[1]):
            scales.append((node.args[1], -1))
            rest = node.args[0]
        else:
            break
        take(node)
        node = rest
    return node, scales


def _factors(node, take, tensors: list, scales: list) -> None:
    """Flatten a product of tensors and scalars (mul, div by a scalar) into its factors."""
    if is_op(node, aten.mul.Tensor):
        take(node)
        for a in node.args[:2]:
            if _is_scalar(a):
                scales.append((a, 1))
            else:
                _factors(a, take, tensors, scales)
    elif is_op(node, aten.div.Tensor) and _is_scalar(node.args[1]):
        take(node)
        scales.append((node.args[1], -1))
        _factors(node.args[0], take, tensors, scales)
    else:
        tensors.append(node)


def _check_scale(scales: list, dk_size) -> None:
    """The scalar factors multiply to 1/sqrt(DQK): numbers, against a static head dim (a literal
    against a symbolic one would hold at one size only), or one symbolic sqrt of it."""
    symbolic = [(s, p) for s, p in scales if isinstance(s, torch.fx.Node)]
    numbers_ = [(s, p) for s, p in scales if not isinstance(s, torch.fx.Node)]
    value = math.prod(float(s) ** p for s, p in numbers_) if numbers_ else 1.0
    if not symbolic:
        if not isinstance(dk_size, int):
            raise NoMatch("a literal scale with a symbolic head dim (it would hold at one size only)")
        if not math.isclose(value, dk_size ** -0.5, rel_tol=1e-6):
            raise NoMatch("q k^T is scaled by something other than 1/sqrt(DQK)" if scales else
                          "no 1/sqrt(DQK) scale on q k^T")
        return
    if len(symbolic) == 1 and math.isclose(value, 1.0, rel_tol=1e-6):
        node, power = symbolic[0]
        if _symbolic_equal(node, dk_size, -0.5 * power):
            return
    raise NoMatch("q k^T is scaled by something other than 1/sqrt(DQK)")


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


# ---- the normalizer and the stabilizer ---------------------------------------------------------

def _normalized(x, walk: Walk) -> tuple:
    """(C, eps, m) of C / (maximum(|C.sum(-1, keepdim=True)|, exp(-m)) [+ eps])."""
    take = walk.take
    div = take(expect(x, aten.div.Tensor, what="C / (normalizer + eps)"))
    C, den = div.args[0], div.args[1]
    eps = 0.0
    if is_op(den, aten.add.Tensor, aten.add.Scalar):
        numbers_ = [a for a in den.args[:2] if not isinstance(a, torch.fx.Node)]
        dynamic = [a for a in den.args[:2] if isinstance(a, torch.fx.Node) and not isinstance(val(a), torch.Tensor)]
        if dynamic:
            raise DynamicEps()
        if len(numbers_) != 1 or len(den.args) > 2 and den.args[2] != 1:
            raise NoMatch("the normalizer adds something other than a constant eps")
        take(den)
        eps = numbers_[0]
        den = den.args[0] if isinstance(den.args[0], torch.fx.Node) else den.args[1]
    mx = take(expect(den, aten.maximum.default, aten.max.other, what="maximum(|sum C|, exp(-m))"))

    def abs_rowsum(node):
        a = expect(node, aten.abs.default, what="abs")
        s = expect(a.args[0], aten.sum.dim_IntList, what="sum over the last dim")
        if s.args[0] is not C or not _dims(s, [-1]) or not (s.args[2] if len(s.args) > 2 else s.kwargs.get("keepdim")):
            raise NoMatch("normalizer is not |C.sum(-1, keepdim=True)|")
        return take(a), take(s)

    _, e = _either(mx, abs_rowsum, walk)
    take(expect(e, aten.exp.default, what="exp(-m)"))
    neg = take(expect(e.args[0], aten.neg.default, what="-m"))
    return C, eps, neg.args[0]


def _factors_of_C(C, m, take) -> tuple:
    """((q k^T, scalar factors), D) of C = q k^T * D times scalars, in any order."""
    tensors, scales = [], []
    _factors(C, take, tensors, scales)
    if len(tensors) != 2:
        raise NoMatch(f"C is a product of {len(tensors)} tensors, expected q k^T and D")
    for D, qk in (tensors, tensors[::-1]):
        if is_op(D, aten.exp.default) and is_op(D.args[0], aten.sub.Tensor) and D.args[0].args[1] is m:
            return (qk, scales), D
    raise NoMatch("C has no factor D = exp(logD - m) stabilized by the normalizer's m")


def _stabilized(D, m, take):
    """logD of D = exp(logD - m) with m its row maximum (amax, or max's values)."""
    sub = D.args[0]
    take(D), take(sub)
    logD = sub.args[0]
    if is_op(m, operator.getitem) and m.args[1] == 0 and is_op(m.args[0], aten.max.dim):
        reduction = m.args[0]
        if any(u.args[1] != 0 for u in reduction.users if u is not m and u.users):
            raise NoMatch("the row maximum's indices are used")
        take(m), take(reduction)
        for u in list(reduction.users):
            if u is not m:
                take(u)
        keepdim = reduction.args[2] if len(reduction.args) > 2 else reduction.kwargs.get("keepdim", False)
    else:
        reduction = take(expect(m, aten.amax.default, what="m = the row maximum of logD"))
        keepdim = reduction.args[2] if len(reduction.args) > 2 else reduction.kwargs.get("keepdim", False)
    if reduction.args[0] is not logD or not _dims(reduction, [-1]) or not keepdim:
        raise NoMatch("m is not logD's maximum over its last dim (keepdim=True)")
    return logD


# ---- the log decay matrix ------------------------------------------------------------------------

def _log_decay(logD, walk: Walk) -> tuple:
    """(Fc, i) of logD = mask(Fc[t] - Fc[s] + i[s]) with exactly one causal -inf mask, before or
    after adding i."""
    take = walk.take

    def unmasked(node):
        node = skip_full_slices(node, take)
        node, was = causal_mask.masked(node, take, walk.checks)
        walk.masks.extend([node] if was else [])
        return skip_full_slices(node, take)

    total = unmasked(logD)
    plus_i = take(expect(total, aten.add.Tensor, what="pairwise gate sums + i"))
    if len(plus_i.args) > 2 and plus_i.args[2] != 1:
        raise NoMatch("pairwise gate sums + alpha * i")
    Fc, igate = _either(plus_i, lambda node: _pairwise(unmasked(node), take), walk)
    i = _gate_row(igate, take)
    if len(walk.masks) != 1:
        raise NoMatch("no causal -inf mask on the log-decay matrix" if not walk.masks else "two -inf masks")
    return Fc, i


def _pairwise(node, take):
    """Fc of Fc[t] - Fc[s], as the difference of a column and a row view of one cumsum, or the
    xlstm package's padded form."""
    if is_op(node, aten.slice.Tensor):
        return _padded_pairwise(node, take)
    d = expect(node, aten.sub.Tensor, what="Fc[:, None] - Fc[None, :]")
    views: list = []
    a0 = _gate_column(d.args[0], views.append)
    a1 = _gate_row(d.args[1], views.append)
    if a0 is not a1 or len(d.args) > 2 and d.args[2] != 1:
        raise NoMatch("pairwise difference of two different cumsums")
    take(d)
    for n in views:
        take(n)
    return a0


def _padded_pairwise(node, take):
    """The xlstm package's form: P = cat(zeros [B, NH, 1, 1], cumsum(logf, -2)); R = P.repeat(1, 1, 1,
    S + 1); (R - R^T)[:, :, 1:, 1:], whose [t, s] entry is Fc[t] - Fc[s]."""
    cut = []
    while is_op(node, aten.slice.Tensor):
        dim, start = node.args[1] % 4, node.args[2] if len(node.args) > 2 else 0
        end, step = (node.args[3] if len(node.args) > 3 else None), (node.args[4] if len(node.args) > 4 else 1)
        if step != 1 or end not in (None, FULL_END) and not isinstance(end, (int, torch.SymInt)):
            raise NoMatch("a strided slice of the pairwise differences")
        if (dim, start) not in ((0, 0), (1, 0), (2, 1), (3, 1)) or dim in cut:
            raise NoMatch("the pairwise differences cut other than [1:, 1:]")
        if start:
            cut.append(dim)
        take(node)
        node = node.args[0]
    if sorted(cut) != [2, 3]:
        raise NoMatch("the pairwise differences cut other than [1:, 1:]")
    d = take(expect(node, aten.sub.Tensor, what="R - R^T"))
    rep = d.args[0]
    if _transposed_of(d.args[1]) is not rep:
        raise NoMatch("not R - R^T")
    take(d.args[1])
    take(expect(rep, aten.repeat.default, what="the padded cumsum repeated over columns"))
    if list(rep.args[1])[:3] != [1, 1, 1]:
        raise NoMatch("the padded cumsum repeated over other dims")
    cat = take(expect(rep.args[0], aten.cat.default, what="cat(zeros, cumsum)"))
    parts = cat.args[0]
    if len(parts) != 2 or (cat.args[1] if len(cat.args) > 1 else 0) % 4 != 2:
        raise NoMatch("the cumsum padded other than by one leading zero position")
    if not _is_zeros(parts[0]) or tuple(val(parts[0]).shape[-2:]) != (1, 1):
        raise NoMatch("the cumsum padded by something other than one zero position")
    take(parts[0])
    return parts[1]


_ZERO_FACTORIES = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)


def _is_zeros(node) -> bool:
    """Zeros whatever the sizes: a zeros factory, or a constant whose value is all zero."""
    if is_op(node, *_ZERO_FACTORIES):
        return True
    value = causal_mask.constant_value(node)
    return value is not None and not bool(value.any())


def _transposed_of(node):
    try:
        return _transposed(node)
    except NoMatch:
        return None


def _forget_gate(Fc, take):
    """f of Fc = cumsum(logsigmoid(f)) over the sequence dim."""
    cs = take(expect(Fc, aten.cumsum.default, what="cumsum of logsigmoid(f)"))
    rank = val(cs).dim()
    seq_dim = rank - (2 if rank == 4 else 1)  # [B, NH, S] or [B, NH, S, 1] gates
    if cs.args[1] % rank != seq_dim or cs.kwargs.get("dtype") is not None:
        raise NoMatch("cumsum not over the sequence dim")
    logf = cs.args[0]
    if is_op(logf, aten.log_sigmoid.default):
        return take(logf).args[0]
    if is_op(logf, aten.log.default) and is_op(logf.args[0], aten.sigmoid.default):
        take(logf)
        return take(logf.args[0]).args[0]
    if is_op(logf, aten.neg.default) and is_op(logf.args[0], aten.softplus.default) and \
            is_op(logf.args[0].args[0], aten.neg.default) and tuple(logf.args[0].args[1:]) in ((), (1,), (1, 20)):
        take(logf), take(logf.args[0]), take(logf.args[0].args[0])
        return logf.args[0].args[0].args[0]
    raise NoMatch("expected logsigmoid(f) under the cumsum")


# ---- gates as rows and columns ---------------------------------------------------------------------

def _unsqueezed(node, dim: int, take):
    """The tensor that `node` is, unsqueezed at `dim` (negative, counted on the result)."""
    node = skip_full_slices(node, take)
    expect(node, aten.unsqueeze.default, what=f"an unsqueeze at dim {dim}")
    rank = val(node).dim()
    if node.args[1] % rank != dim % rank:
        raise NoMatch(f"unsqueeze at dim {node.args[1]}, expected {dim}")
    take(node)
    return skip_full_slices(node.args[0], take)


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
    node = skip_full_slices(node, take)
    if is_op(node, aten.transpose.int, aten.permute.default):
        g = _transposed_of(node)
        t = val(g) if g is not None else None
        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[-1] == 1:
            take(node)
            return g
    return _unsqueezed(node, -2, take)


# ---- small helpers -----------------------------------------------------------------------------------

def _either(node, test, walk: Walk):
    """(what `test` returns for one of a binary node's two args, the other arg); a failed try is
    undone."""
    a, b = node.args[0], node.args[1]
    first = None
    for x, y in ((a, b), (b, a)):
        try:
            return walk.attempt(test, x), y
        except NoMatch as e:
            first = first or e
    raise NoMatch(f"neither input of {node.name} matches ({first})")


def _dims(node, want) -> bool:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims)
    rank = val(node.args[0]).dim()
    return [d % rank for d in dims] == [w % rank for w in want]


def _check_inputs(inputs: dict) -> None:
    for name, node in inputs.items():
        t = val(node)
        want = (4,) if name in "qkv" else (3, 4)  # gates [B, NH, S] or [B, NH, S, 1]
        if (not isinstance(t, torch.Tensor) or t.dim() not in want or not t.dtype.is_floating_point
                or (name in "if" and t.dim() == 4 and t.shape[-1] != 1)):
            raise NoMatch(f"{name} is not a {'4-D' if name in 'qkv' else '[B, NH, S] or [B, NH, S, 1]'} float tensor")
    if val(inputs["q"]).dtype != val(inputs["k"]).dtype or val(inputs["q"]).dtype != val(inputs["v"]).dtype:
        raise NoMatch("q, k, v dtypes differ")
