"""One hand-written sLSTM step in an ATen graph: where it is, what it computes, and how its
tensors map onto xaccel::slstm and xaccel::slstm_step. Shared by step.py (a lone step) and
loops.py (a loop of steps that Dynamo unrolled).

Users write the step in many layouts: states [B, NH, D] or [B, NH*D]; the recurrence as an
einsum, per-head matmuls, a bmm or one batched matmul; the gates split by chunk, unbind or
indexing, along any dim. Rather than one pattern per layout, a step is found by its elementwise
core and its layouts are then measured:

1. `find_core` walks from logsigmoid(f) through the stabilized exponential gating to the new
   states (h', c', n', m'), the old ones (c, n, m) and the gate pre-activations (i, f, z, o). Any
   unary function of z and o, either argument order and optional clamps pass: look-alikes reach
   the proof and are refused with a number, not silently skipped.
2. `build_cell` adds the pre-activation: the nodes linear in the old h between it and the gates.
   What else they read (a slice of Wx, R, b, a projection) are the cell's roots, taken up through
   views to the tensor viewed, so that a time slice Wx[:, t] has Wx itself as its root.
3. `measure` runs the pre-activation on structured float64 inputs: which roots add (Wx, b) and
   which multiply h (R); which state positions form one (batch, head) block (one probe, R = 1)
   and which blocks share a head (one probe); R's entries by index-coded probes, one per unit; and
   each additive root's entry at each gate position by one index-coded probe. These measurements
   become `Plan`s, views from the roots to the op's layouts.
4. `prove` runs the step as written (fp32, random roots and states: rows with n > 0; rows with
   n == 0 among others; n == 0 everywhere; several draws each) against reference.step of every
   variant with the inputs the plans build. The variants within TOL agree; `choose` takes the
   one left, and refuses when the proofs could not tell two different ones apart.

Code without a fresh rule, m' = max(i, logsigmoid(f) + m) at every step: the op cannot express it
in general. (c, n) stand for the true state (c e^m, n e^m), and without clamps every rule evolves
the same true state (the gates enter linearly), so:
- h = o c / n is the same for every initial state and every stabilizer: such code equals the op
  (element rule, no clamps) in h;
- c, n, m agree only if the op never treats a row as fresh, i.e. n0 != 0 everywhere. From the zero
  start every row is fresh at the first step (the op's m1 = i1, the code's max(i1, logsigmoid(f1))),
  so the states differ by the factor exp(m_op - m_code) from then on;
- min(exp(.), 1) changes nothing in such code (after the max both exponents are <= 0);
- n' = max(n', 1) acts on the stabilized n and so depends on the stabilizer: from the zero start
  h1 = o tanh(z) exp(i1 - m1) there, o tanh(z) in every variant of the op.
So such code is replaced only without an n clamp and when nothing reads its c, n or m (NO_RULE).

An n clamp written clamp(n, min=1) has the op's forward but not its gradient at the tie n' = 1 of
a fresh row, where the op (as torch.maximum(n, 1), FlashRNN's form) splits it (Core.n_tie_differs):
it is replaced where that gradient cannot reach anything.
"""
from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass, field, replace

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Node

from torch_xaccel.ops.slstm import reference

aten = torch.ops.aten
TOL = 1e-5  # relative, fp32, per output: the step as written vs reference.step
NO_RULE = "none"  # the hypothesis "no fresh rule" (see the module docstring); never an op variant
VARIANTS = [(fresh, cg, cn) for fresh in ("element", "batch") for cg in (False, True) for cn in (False, True)] + [
    (NO_RULE, False, cn) for cn in (False, True)]
MAX_UNITS = 1024  # R is measured with one probe per unit of a head
MAX_ROOT = 1 << 26  # a root is taken up through views only while the viewed tensor stays this small
DRAWS = 3  # random draws per regime of old states in a proof

_MAX = (aten.maximum.default, aten.max.other)
_MIN = (aten.minimum.default, aten.min.other)
_CASTS = (aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout)
_VIEWS = tuple(op for op in (
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, getattr(aten.squeeze, "dims", None),
    aten.squeeze.default, aten.select.int, aten.slice.Tensor, aten.narrow.default, aten.expand.default,
    aten.alias.default, aten.unflatten.int, aten.flatten.using_ints, aten.movedim.int, aten.clone.default,
    getattr(aten, "contiguous", None) and aten.contiguous.default,
    aten.detach.default, aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    operator.getitem, *_CASTS) if op is not None)
_LINEAR = _VIEWS + (aten.matmul.default, aten.mm.default, aten.bmm.default, aten.einsum.default, aten.linear.default,
                    aten.addmm.default, aten.baddbmm.default, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor,
                    aten.div.Tensor, aten.neg.default, aten.stack.default, aten.cat.default)
_ZERO_FACTORIES = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)
_FILL_FACTORIES = (aten.full.default, aten.full_like.default, aten.new_full.default)
_FACTORIES = _ZERO_FACTORIES + _FILL_FACTORIES + (
    aten.ones.default, aten.ones_like.default, aten.new_ones.default, aten.scalar_tensor.default,
    aten.empty_like.default)


class NoMatch(Exception):
    """A step of the search did not hold; `depth` says how far the sLSTM shape held."""

    def __init__(self, why: str, depth: int = 0):
        super().__init__(why)
        self.depth = depth


def is_op(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def looks_like_slstm(graph: torch.fx.Graph) -> bool:
    """The cheap filter: exponential gating stabilized with a logsigmoid forget gate, and two
    squashing activations. Graphs without them cost one pass over their nodes."""
    seen = {"ls": 0, "exp": 0, "max": 0, "act": 0}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is aten.log_sigmoid.default:
            seen["ls"] += 1
        elif n.target is aten.exp.default:
            seen["exp"] += 1
        elif n.target in _MAX:
            seen["max"] += 1
        elif n.target in (aten.tanh.default, aten.sigmoid.default):
            seen["act"] += 1
    return seen["ls"] >= 1 and seen["exp"] >= 2 and seen["max"] >= 1 and seen["act"] >= 2


def fold_same_dtype_casts(graph: torch.fx.Graph) -> None:
    """x.to(x.dtype) returns x itself, so the node is replaced by x. Code that casts its states
    every step (`c = c.to(Wx.dtype)`) then chains its steps directly, and each h stacked is the
    step's own h."""
    for n in list(graph.find_nodes(op="call_function", target=aten.to.dtype)):
        x = n.args[0]
        extra = list(n.args[2:]) + list(n.kwargs.values())
        if isinstance(val(x), torch.Tensor) and val(n).dtype == val(x).dtype and not any(extra):
            n.replace_all_uses_with(x)
            graph.erase_node(n)


def is_zeros(node) -> bool:
    """A tensor of zeros built in the graph (through copies and views): a zero start state."""
    while is_op(node, *_VIEWS) and node.target is not operator.getitem:
        node = node.args[0]
    if is_op(node, *_ZERO_FACTORIES):
        return True
    return is_op(node, *_FILL_FACTORIES) and node.args[-1] == 0


def tensor_roots_refusal(cell) -> str | None:
    """Why the step's roots are not all tensors (a root left as a tuple of tensors, where a
    symbolic size stops the walk up through views), or None."""
    odd = next((r for r in cell.roots if not isinstance(val(r), torch.Tensor)), None)
    return None if odd is None else f"the step reads {odd.name}, a {type(val(odd)).__name__} of tensors, as one input"


def static_shape(node) -> tuple | None:
    """The node's shape when every size is a plain int (dynamic sizes: None)."""
    v = val(node)
    if not isinstance(v, torch.Tensor) or not all(isinstance(s, int) for s in v.shape):
        return None
    return tuple(v.shape)


def size_hint(size) -> int | None:
    """A size as an int: its value, or a symbolic size's example value (None: unbacked)."""
    return size if isinstance(size, int) else getattr(size.node, "hint", None)


def example_shape(node) -> tuple | None:
    """The node's shape at the example sizes the graph was traced with (symbolic sizes as their
    example values): the sizes the layouts are measured and proven at."""
    v = val(node)
    if not isinstance(v, torch.Tensor):
        return None
    hints = tuple(size_hint(s) for s in v.shape)
    return None if None in hints else hints


def is_size(node) -> bool:
    """A node computing a symbolic size (x.shape[0] under dynamic shapes): an integer the step
    reads for its views, not a tensor root; measuring and proving run it at its example value."""
    return isinstance(node, Node) and isinstance(val(node), torch.SymInt)


# ---- 1. the elementwise core -------------------------------------------------------------------

@dataclass(eq=False)
class Core:
    L: Node  # logsigmoid(f)
    gates: dict  # i, f, z, o -> pre-activation node
    old: dict  # c, n, m -> node
    new: dict  # h, c, n, m -> node
    # n clamped by clamp(n, min=1): at n' = 1 (a fresh row) it passes the gradient whole, where the
    # op's clamp (torch.maximum(n', 1)) splits it with the 1; the same forward, another gradient
    # for the old n
    n_tie_differs: bool = False


def _other(node, x):
    a, b = node.args[0], node.args[1]
    return b if a is x else a if b is x else None


def _unary_input(node):
    ins = node.all_input_nodes if isinstance(node, Node) and node.op == "call_function" else []
    return ins[0] if len(ins) == 1 else None


def _exp_of_diff(x, m):
    """exp(x - m) among m's users, or None."""
    subs = [u for u in m.users if is_op(u, aten.sub.Tensor) and u.args[0] is x and u.args[1] is m]
    exps = [e for s in subs for e in s.users if is_op(e, aten.exp.default)]
    return exps[0] if len(exps) == 1 else None


def _clamped(g, upper: bool):
    """g clamped from above at 1 (min(g, 1), clamp(g, max=1)) or, upper=False, from below
    (max(g, 1), clamp(g, min=1)), if g has exactly one such user; else g. The proof decides what
    the clamp does."""
    if upper:
        users = [u for u in g.users if is_op(u, *_MIN) or is_op(u, aten.clamp_max.default)
                 or (is_op(u, aten.clamp.default) and u.args[0] is g and len(u.args) > 2 and u.args[2] is not None)]
    else:
        users = [u for u in g.users if is_op(u, *_MAX) or is_op(u, aten.clamp_min.default)
                 or (is_op(u, aten.clamp.default) and u.args[0] is g and len(u.args) > 1 and u.args[1] is not None)]
    return users[0] if len(users) == 1 else g


def _h_of(c_new, n_new):
    """(h', act(o)) for h' = act(o) * (c' / n') or act(o) * c' / n', either argument order."""
    for d in c_new.users:
        if is_op(d, aten.div.Tensor) and d.args[0] is c_new and d.args[1] is n_new:
            for u in d.users:
                if is_op(u, aten.mul.Tensor) and d in u.args[:2]:
                    return u, _other(u, d)
    for p in c_new.users:
        if is_op(p, aten.mul.Tensor) and c_new in p.args[:2]:
            for u in p.users:
                if is_op(u, aten.div.Tensor) and u.args[0] is p and u.args[1] is n_new:
                    return u, _other(p, c_new)
    return None, None


def find_core(L: Node) -> Core:
    """The sLSTM update around L = logsigmoid(f):

        m' = max(i, L + m)  [or where(rule, i, max(...))];  i' = exp(i - m'), f' = exp(L + m - m')
        [each optionally clamped above];  c' = f' c + i' act_z(z);  n' = f' n + i' [clamped below]
        h' = act_o(o) c' / n'
    Raises NoMatch with the depth reached."""
    depth = 0

    def need(ok, why):
        if not ok:
            raise NoMatch(why, depth)

    adds = [u for u in L.users if is_op(u, aten.add.Tensor) and L in u.args[:2]]
    need(len(adds) == 1, "logsigmoid(f) is not added to a stabilizer m")
    A = adds[0]
    m_old = _other(A, L)
    need(isinstance(m_old, Node), "logsigmoid(f) + m with a constant m")
    depth = 1
    mxs = [u for u in A.users if is_op(u, *_MAX) and A in u.args[:2]]
    need(len(mxs) == 1, "no max(i, logsigmoid(f) + m)")
    mx = mxs[0]
    i = _other(mx, A)
    need(isinstance(mx, Node) and isinstance(i, Node), "max with a constant")
    depth = 2
    rules = [u for u in mx.users if is_op(u, aten.where.self) and {id(a) for a in u.args[1:3]} == {id(i), id(mx)}]
    m_new = rules[0] if len(rules) == 1 else mx
    ig0, fg0 = _exp_of_diff(i, m_new), _exp_of_diff(A, m_new)
    need(ig0 is not None and fg0 is not None, "the gates are not exp(i - m') and exp(logsigmoid(f) + m - m')")
    depth = 3
    ig, fg = _clamped(ig0, True), _clamped(fg0, True)
    c_new = c_old = n_new = n_old = z_act = None
    for mul in [u for u in fg.users if is_op(u, aten.mul.Tensor) and fg in u.args[:2]]:
        x = _other(mul, fg)
        for add in [u for u in mul.users if is_op(u, aten.add.Tensor) and mul in u.args[:2]]:
            y = _other(add, mul)
            if y is ig:
                n_new, n_old = add, x
            elif is_op(y, aten.mul.Tensor) and ig in y.args[:2]:
                c_new, c_old, z_act = add, x, _other(y, ig)
    need(c_new is not None and n_new is not None and isinstance(c_old, Node) and isinstance(n_old, Node),
         "no c' = f' c + i' act(z) and n' = f' n + i'")
    depth = 4
    n_sum = n_new
    n_new = _clamped(n_new, False)
    tie_differs = n_new is not n_sum and not is_op(n_new, *_MAX)
    h_new, o_act = _h_of(c_new, n_new)
    need(h_new is not None, "no h' = act(o) c' / n'")
    depth = 5
    z, o = _unary_input(z_act), _unary_input(o_act)
    need(z is not None and o is not None, "the cell input or the output gate is not a function of one gate")
    gates = dict(i=i, f=L.args[0], z=z, o=o)
    need(len({id(g) for g in gates.values()}) == 4, "the four gates are not four tensors")
    return Core(L, gates, dict(c=c_old, n=n_old, m=m_old), dict(h=h_new, c=c_new, n=n_new, m=m_new), tie_differs)


# ---- 2. the cell: pre-activation, roots, region ---------------------------------------------------

@dataclass(eq=False)
class Cell:
    core: Core
    h_old: Node
    region: list  # every node of the step, in graph order
    roots: list  # what the pre-activation reads besides h (Wx, R, b, ...), in first-use order
    consts: list  # tensors read only for their shape (ones_like(x) of an outside x)
    pre: list  # the pre-activation's nodes (h and roots -> gates), in graph order
    shape: tuple  # the states' and gates' shape S

    @property
    def inputs(self) -> list:
        return [self.h_old, self.core.old["c"], self.core.old["n"], self.core.old["m"], *self.roots, *self.consts]

    def dependent(self) -> set:
        """Region nodes that depend on the old states (the rest are views of roots)."""
        states = {self.h_old, *self.core.old.values()}
        out = set()
        for n in self.region:
            if any(a in states or a in out for a in n.all_input_nodes):
                out.add(n)
        return out


def _linear_closure(h: Node, gates, order) -> set | None:
    """Nodes on linear-op paths from h to the gates (h excluded); None when a gate is not on one.
    Only nodes placed before the last gate can be on such a path."""
    limit = max(order[g] for g in gates)
    fwd, todo = {h}, [h]
    while todo:
        for u in todo.pop().users:
            if u not in fwd and order.get(u, limit + 1) <= limit and is_op(u, *_LINEAR):
                fwd.add(u)
                todo.append(u)
    if any(g not in fwd for g in gates):
        return None
    keep, todo = set(), list(gates)
    while todo:
        x = todo.pop()
        if x in keep or x is h:
            continue
        keep.add(x)
        todo.extend(a for a in x.all_input_nodes if a in fwd)
    return keep


def _viewed(node):
    """The tensor `node` views (a view, copy or dtype cast of one tensor), or None."""
    if not is_op(node, *_VIEWS) or len(node.all_input_nodes) != 1 or node.all_input_nodes[0] is not node.args[0]:
        return None
    src = node.args[0]
    v = val(src)
    if isinstance(v, (tuple, list)):  # getitem of unbind/split: the tuple's source is the tensor
        return src if all(isinstance(t, torch.Tensor) and isinstance(t.numel(), int) for t in v) else None
    return src if isinstance(v, torch.Tensor) and isinstance(v.numel(), int) and v.numel() <= MAX_ROOT else None


def _roots(pre: set, h: Node, order) -> tuple[list, set]:
    """(roots in first-use order, the view nodes between roots and the pre-activation)."""
    roots, views = [], set()
    for n in sorted(pre, key=order.__getitem__):
        for a in n.all_input_nodes:
            if a in pre or a is h or a in views or is_size(a):
                continue
            r = a
            while (src := _viewed(r)) is not None:
                views.add(r)
                r = src
            if r not in roots:
                roots.append(r)
    return roots, views


def _core_region(core: Core, h_old: Node, order) -> tuple[set, list]:
    """(the update's nodes from the gates and old states to the new states, the outside tensors
    read only for their shape by factories such as ones_like)."""
    stops = {*core.gates.values(), *core.old.values(), h_old}
    lo = min(order[x] for x in stops)
    region, consts, todo = set(), [], list(core.new.values())
    while todo:
        x = todo.pop()
        if x in region or x in stops:
            continue
        if is_op(x, *_FACTORIES):
            region.add(x)
            consts.extend(a for a in x.all_input_nodes if a not in stops and a not in consts)
            continue
        if x.op != "call_function" or order[x] < lo:
            raise NoMatch(f"the update reads {x.name}, not only its gates and states", 5)
        region.add(x)
        todo.extend(x.all_input_nodes)
    consts = [c for c in consts if c not in region]
    return region, consts


def build_cell(core: Core, h_old: Node, order) -> Cell:
    pre = _linear_closure(h_old, list(core.gates.values()), order)
    if pre is None:
        raise NoMatch(f"the gates are not linear in {h_old.name}", 5)
    roots, views = _roots(pre, h_old, order)
    update, consts = _core_region(core, h_old, order)
    pre_nodes = sorted(pre | views, key=order.__getitem__)
    region = sorted(set(pre_nodes) | update, key=order.__getitem__)
    shape = example_shape(core.new["h"])
    cell = Cell(core, h_old, region, roots, consts, pre_nodes, shape)
    known = set(region) | set(cell.inputs)
    stray = [a.name for n in region for a in n.all_input_nodes if a not in known and not is_size(a)]
    if stray:
        raise NoMatch(f"the step reads {stray[0]} from outside", 5)
    return cell


def h_candidates(core: Core, order) -> list:
    """Nodes that may be the old h: tensors of the states' shape from which the gates are reached
    by linear ops, nearest first."""
    shape = example_shape(core.new["h"])
    seen, out, frontier = set(core.gates.values()), [], list(core.gates.values())
    while frontier:
        nxt = []
        for x in frontier:
            for a in x.all_input_nodes if is_op(x, *_LINEAR) else ():
                if a in seen:
                    continue
                seen.add(a)
                if example_shape(a) == shape and a not in out:
                    out.append(a)
                nxt.append(a)
        frontier = nxt
    olds = set(core.old.values())  # an old c, n or m only where one tensor starts every state
    return [a for a in out if a not in olds] + [a for a in out if a in olds]


def escapes(cell: Cell, allowed: set) -> list:
    """State-dependent step nodes read outside the step (besides the new states and `allowed`)."""
    region = set(cell.region)
    outs = set(cell.core.new.values())
    return [n for n in cell.dependent() if n not in outs and any(u not in region and u not in allowed for u in n.users)]


# ---- extraction ---------------------------------------------------------------------------------

def extract(nodes, inputs, outputs, strip_casts=False, batch: int | None = None) -> torch.fx.GraphModule:
    """The nodes as a callable of `inputs` (one argument each, duplicates allowed) returning
    `outputs`. strip_casts: float-to-float casts become identities (for float64 probes). The
    symbolic sizes the nodes read become ints: their example values, or `batch` for a symbolic
    batch size (see BatchSize)."""
    g = torch.fx.Graph()
    env = {}

    def arg(a):
        if a in env:
            return env[a]
        if is_size(a):
            return batch if batch is not None else size_hint(val(a))
        raise KeyError(a)
    for k, x in enumerate(inputs):
        p = g.placeholder(f"in{k}")
        env.setdefault(x, p)
    for n in nodes:
        if n in env:
            continue
        if strip_casts and is_op(n, *_CASTS) and isinstance(val(n), torch.Tensor) and val(n).is_floating_point() \
                and val(n.args[0]).is_floating_point():
            env[n] = env[n.args[0]]
            continue
        env[n] = g.node_copy(n, arg)
    g.output(tuple(env[o] for o in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), g)


# ---- plans: views from roots to the op's tensors ---------------------------------------------------

class Plan:
    """How one of the op's tensors is made from the roots (indices into a list of root tensors):
    run on real tensors for the proof, emitted as graph nodes for the rewrite. `batch`: the size
    of the op's batch axis (axis 0 of Wx and the states) where it is symbolic, an int to run at
    or a graph node to emit with; None keeps the measured size."""
    shape: tuple

    def run(self, vals, like, batch=None):
        raise NotImplementedError

    def emit(self, em, nodes, like, batch=None):
        raise NotImplementedError


def _with_batch(sizes, axes, batch) -> list:
    """sizes (one per op axis in `axes`) with the batch axis's size replaced by `batch`."""
    return [batch if batch is not None and a == 0 else n for a, n in zip(axes, sizes)]


@dataclass
class View(Plan):
    """op[c] = root.flatten()[offset + sum(strides * c)]: a reshape + permute of the root when
    that is what the map is (a stride 0 is a broadcast), as_strided otherwise."""
    root: int
    root_shape: tuple
    shape: tuple
    strides: tuple
    offset: int = 0

    def packed_order(self) -> list | None:
        """The op axes of size > 1 read from the root, outermost first, where the map is a
        reshape + permute of the whole root (else None: as_strided)."""
        real = [a for a, n in enumerate(self.shape) if n > 1 and self.strides[a] != 0]
        order = sorted(real, key=lambda a: -self.strides[a])
        sizes = [self.shape[a] for a in order]
        packed = (self.offset == 0 and math.prod(sizes) == math.prod(self.root_shape)
                  and all(self.strides[order[k]] == self.strides[order[k + 1]] * sizes[k + 1]
                          for k in range(len(order) - 1))
                  and (not order or self.strides[order[-1]] == 1))
        return order if packed else None

    def ops(self, batch=None) -> list:
        real = [a for a, n in enumerate(self.shape) if n > 1 and self.strides[a] != 0]
        numel = math.prod(self.root_shape)
        order = self.packed_order()
        ops = []
        if order is not None:
            sizes = [self.shape[a] for a in order]
            if batch is not None or list(self.root_shape) != sizes:
                ops.append((aten.reshape.default, (_with_batch(sizes, order, batch),)))
            perm = [order.index(a) for a in real]
            if perm != sorted(perm):
                ops.append((aten.permute.default, (perm,)))
        else:  # (with a symbolic batch: check_batch_layouts allows this only batch row by batch row)
            ops.append((aten.reshape.default, ([-1],)))
            if self.offset:
                ops.append((aten.slice.Tensor, (0, self.offset) if batch is not None else (0, self.offset, numel)))
            ops.append((aten.as_strided.default, (_with_batch([self.shape[a] for a in real], real, batch),
                                                  [self.strides[a] for a in real])))
        axes = range(len(self.shape))
        full = [n if a in real else 1 for a, n in enumerate(self.shape)]
        if batch is not None or full != [self.shape[a] for a in real]:
            ops.append((aten.reshape.default, (_with_batch(full, axes, batch if 0 in real else None),)))
        if full != list(self.shape):
            ops.append((aten.expand.default, (_with_batch(self.shape, axes, batch),)))
        return ops

    def run(self, vals, like, batch=None):
        x = vals[self.root]
        for op, args in self.ops(batch):
            x = op(x, *args)
        return x

    def emit(self, em, nodes, like, batch=None):
        x = nodes[self.root]
        for op, args in self.ops(batch):
            x = em(op, x, *args)
        return x


@dataclass
class Stack(Plan):
    axis: int
    parts: list

    @property
    def shape(self):
        s = list(self.parts[0].shape)
        s.insert(self.axis, len(self.parts))
        return tuple(s)

    def run(self, vals, like, batch=None):
        return torch.stack([p.run(vals, like, batch) for p in self.parts], self.axis)

    def emit(self, em, nodes, like, batch=None):
        return em(aten.stack.default, [p.emit(em, nodes, like, batch) for p in self.parts], self.axis)


@dataclass
class Zeros(Plan):
    shape: tuple

    def run(self, vals, like, batch=None):
        return like.new_zeros(_with_batch(self.shape, range(len(self.shape)), batch))

    def emit(self, em, nodes, like, batch=None):
        v = val(like)
        return em(aten.zeros.default, _with_batch(self.shape, range(len(self.shape)), batch), dtype=v.dtype,
                  device=v.device)


@dataclass
class Sum(Plan):
    parts: list

    @property
    def shape(self):
        return self.parts[0].shape

    def run(self, vals, like, batch=None):
        out = self.parts[0].run(vals, like, batch)
        for p in self.parts[1:]:
            out = out + p.run(vals, like, batch)
        return out

    def emit(self, em, nodes, like, batch=None):
        out = self.parts[0].emit(em, nodes, like, batch)
        for p in self.parts[1:]:
            out = em(aten.add.Tensor, out, p.emit(em, nodes, like, batch))
        return out


def views(plan: Plan) -> list:
    """The plan's View leaves."""
    if isinstance(plan, View):
        return [plan]
    return [v for p in getattr(plan, "parts", ()) for v in views(p)]


def rebind(plan: Plan, fn) -> Plan:
    """The plan reading root fn(j) wherever it read root j."""
    if isinstance(plan, View):
        return View(fn(plan.root), plan.root_shape, plan.shape, plan.strides, plan.offset)
    if isinstance(plan, Stack):
        return Stack(plan.axis, [rebind(p, fn) for p in plan.parts])
    if isinstance(plan, Sum):
        return Sum([rebind(p, fn) for p in plan.parts])
    return plan


def timed(plan: Plan, pos: int, T: int, stride: dict) -> Plan:
    """The plan with a time axis of T at `pos`, root j advancing by stride[j] per step (0: the
    same entries at every step)."""
    if isinstance(plan, View):
        return View(plan.root, plan.root_shape, (*plan.shape[:pos], T, *plan.shape[pos:]),
                    (*plan.strides[:pos], stride[plan.root], *plan.strides[pos:]), plan.offset)
    if isinstance(plan, Stack):
        if plan.axis < pos:
            return Stack(plan.axis, [timed(p, pos - 1, T, stride) for p in plan.parts])
        return Stack(plan.axis + 1, [timed(p, pos, T, stride) for p in plan.parts])
    if isinstance(plan, Sum):
        return Sum([timed(p, pos, T, stride) for p in plan.parts])
    return Zeros((*plan.shape[:pos], T, *plan.shape[pos:]))


def fit(idx: torch.Tensor, root: int, root_shape: tuple) -> View | None:
    """The View whose entries are the flat root indices `idx` (all >= 0), if they are affine."""
    shape = tuple(idx.shape)
    off = int(idx.reshape(-1)[0])
    strides, pred = [], torch.full(shape, off, dtype=torch.int64)
    for a, n in enumerate(shape):
        s = int(idx.narrow(a, 1, 1).reshape(-1)[0]) - off if n > 1 else 0
        if s < 0:
            return None
        strides.append(s)
        view = [1] * len(shape)
        view[a] = n
        pred = pred + s * torch.arange(n).view(view)
    return View(root, tuple(root_shape), shape, tuple(strides), off) if torch.equal(pred, idx) else None


def assemble(rid: torch.Tensor, idx: torch.Tensor, shapes: dict, order: list, zeros_ok: bool) -> Plan | None:
    """A plan for a tensor whose entries come from roots (rid: root per entry, -1 none; idx: the
    flat index in it): one view where one root supplies all of it affinely, else stacked slices
    along the axes in `order`, zeros where nothing does (if allowed)."""
    if bool((rid < 0).all()):
        return Zeros(tuple(rid.shape)) if zeros_ok else None
    first = int(rid.reshape(-1)[0])
    if first >= 0 and bool((rid == first).all()):
        v = fit(idx, first, shapes[first])
        if v is not None:
            return v
    for a in order:
        if rid.shape[a] > 1:
            rest = [b - (b > a) for b in order if b != a]
            parts = [assemble(rid.select(a, s), idx.select(a, s), shapes, rest, zeros_ok) for s in range(rid.shape[a])]
            return Stack(a, parts) if all(p is not None for p in parts) else None
    return None


def batch_invariant(table) -> bool:
    """An additive table [B, ...] that is the same for every batch row (a bias)."""
    rid, idx = table
    return bool((rid == rid[:1]).all() and (idx == idx[:1]).all())


def plan_of(tables: list, shapes: dict, order: list) -> Plan | None:
    """One plan summing the tables' roots: tables covering disjoint entries share one assembly
    (one view, or one stack of views); overlapping ones are added."""
    groups: list = []
    for rid, idx in tables:
        for g in groups:
            if not bool(((g[0] >= 0) & (rid >= 0)).any()):
                g[0], g[1] = torch.where(rid >= 0, rid, g[0]), torch.where(rid >= 0, idx, g[1])
                break
        else:
            groups.append([rid.clone(), idx.clone()])
    parts = [assemble(rid, idx, shapes, order, zeros_ok=True) for rid, idx in groups]
    if not parts or any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else Sum(parts)


# ---- the state layout -----------------------------------------------------------------------------

@dataclass
class StateMap:
    """The user's state layout S <-> the op's [B, NH, D]: a permuted reshape. `packed` are the op
    axes of size > 1 in the order they are laid out in S (outermost first)."""
    S: tuple
    B: int
    NH: int
    D: int
    packed: list  # op axes (0 = batch, 1 = head, 2 = unit), outermost first

    @property
    def op_shape(self):
        return (self.B, self.NH, self.D)

    def _to_op(self, batch=None):
        """(op, args(leading sizes)) steps from [*lead, *S] to [*lead, B, NH, D]; `batch`: the
        batch size where it is symbolic (the user's dim 0 then, see BatchSize)."""
        sizes = _with_batch([self.op_shape[a] for a in self.packed], self.packed, batch)
        op_shape = _with_batch(self.op_shape, range(3), batch)
        real = sorted(self.packed)
        perm = [self.packed.index(a) for a in real]
        ops = [(aten.reshape.default, lambda p: ([*p, *sizes],))]
        if perm != sorted(perm):
            ops.append((aten.permute.default, lambda p: ([*range(len(p)), *[len(p) + q for q in perm]],)))
        ops.append((aten.reshape.default, lambda p: ([*p, *op_shape],)))
        return ops

    def _to_user(self, batch=None):
        """The inverse steps, [*lead, B, NH, D] -> [*lead, *S]."""
        real = sorted(self.packed)
        inv = [real.index(a) for a in self.packed]
        sizes = _with_batch([self.op_shape[a] for a in real], real, batch)
        S = _with_batch(self.S, range(len(self.S)), batch)
        ops = [(aten.reshape.default, lambda p: ([*p, *sizes],))]
        if inv != sorted(inv):
            ops.append((aten.permute.default, lambda p: ([*range(len(p)), *[len(p) + q for q in inv]],)))
        ops.append((aten.reshape.default, lambda p: ([*p, *S],)))
        return ops

    def run(self, x, to_op: bool, batch=None):
        lead = list(x.shape[:x.dim() - (len(self.S) if to_op else 3)])
        for op, args in (self._to_op if to_op else self._to_user)(batch):
            x = op(x, *args(lead))
        return x

    def emit(self, em, x, to_op: bool, lead=(), batch=None):
        """The same as graph nodes (reshapes that change nothing left out where every size is
        known)."""
        lead = list(lead)
        for op, args in (self._to_op if to_op else self._to_user)(batch):
            if op is aten.reshape.default and batch is None and list(val(x).shape) == args(lead)[0]:
                continue
            x = em(op, x, *args(lead))
        return x


# ---- 3. measuring the layouts ---------------------------------------------------------------------

class Refused(Exception):
    """The step cannot be mapped onto the op; the message says why."""


@contextlib.contextmanager
def running(what: str):
    """Measuring and proving run the user's nodes on real tensors (outside any fake mode): an
    error there means the code is not replaced, never that the compile fails."""
    try:
        with unset_fake_temporarily():
            yield
    except Refused:
        raise
    except Exception as e:  # noqa: BLE001 - a step we cannot run is a step we do not replace
        raise Refused(f"could not run {what} for the proof ({type(e).__name__}: {e})") from e


@dataclass
class Layout:
    state: StateMap
    recurrent: list  # root indices that multiply h
    R: Plan  # [NH, 4, D, D] from the recurrent roots
    additive: dict = field(default_factory=dict)  # root index -> (rid, idx) tables [B, 4, NH, D]


def _probe_fn(cell: Cell):
    gates = [cell.core.gates[g] for g in "ifzo"]
    return extract(cell.pre, [cell.h_old, *cell.roots], gates, strip_casts=True)


def _close(a, b, scale) -> bool:
    return bool(((a - b).abs() <= 1e-9 * scale + 1e-12).all())


def _clusters(rows: torch.Tensor, tol: float) -> list:
    """Groups of row indices whose rows are equal within tol (rows: [K, F])."""
    keyorder = torch.argsort(rows[:, 0])
    groups, cur = [], [int(keyorder[0])]
    for k in keyorder[1:].tolist():
        if bool(((rows[k] - rows[cur[0]]).abs() <= tol).all()):
            cur.append(k)
        else:
            groups.append(cur)
            cur = [k]
    groups.append(cur)
    return groups


def measure(cell: Cell) -> Layout:
    """The layouts, from probes of the pre-activation in float64 (see the module docstring)."""
    fn = _probe_fn(cell)
    S = cell.shape
    N = math.prod(S)
    shapes = [example_shape(r) for r in cell.roots]
    if any(s is None for s in shapes) or any(not val(r).is_floating_point() for r in cell.roots):
        raise Refused("the step reads a tensor that is not a float tensor of static shape")
    f64 = dict(dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)

    def rnd(shape):
        return torch.randn(shape, generator=gen, **f64)

    def gates(h, vals):
        out = fn(h.reshape(S), *vals)
        if any(tuple(o.shape) != S for o in out):
            raise Refused("the gates do not have the states' shape")
        return torch.stack([o.reshape(-1) for o in out])  # [4, N]

    zeros = [torch.zeros(s, **f64) for s in shapes]
    h0 = torch.zeros(N, **f64)
    alone = [[rnd(s) if k == j else z for k, (s, z) in enumerate(zip(shapes, zeros))] for j in range(len(shapes))]
    additive = [bool(gates(h0, vals).abs().max() > 0) for vals in alone]
    rec = [j for j, a in enumerate(additive) if not a]
    hr, full = rnd(N), [rnd(s) for s in shapes]
    only_rec = [v if j in rec else zeros[j] for j, v in enumerate(full)]
    g_rec = gates(hr, only_rec)
    scale = float(g_rec.abs().max())
    if not rec or scale == 0:
        raise Refused("the gates do not depend on h through a recurrent weight")
    if not (_close(gates(hr, full) - gates(h0, full), g_rec, scale)
            and _close(gates(2 * hr, only_rec), 2 * g_rec, scale)):
        raise Refused("the gates are not Wx_t + R h + b (not affine in h for fixed weights)")
    state = _blocks(gates, shapes, rec, N, S, rnd)
    B, NH, D = state.op_shape
    if D > MAX_UNITS:
        raise Refused(f"heads of {D} units are too large to measure (> {MAX_UNITS})")
    pos = state.run(torch.arange(N).reshape(S), to_op=True)  # [B, NH, D] -> flat position in S
    R = _recurrent(gates, shapes, rec, pos, S, NH, D)
    layout = Layout(state, rec, R)
    layout.additive = additive_tables(cell, layout, fn)
    return layout


def _blocks(gates, shapes, rec, N, S, rnd) -> StateMap:
    """(batch, head) blocks from two probes: with R = 1 each gate sums h over its block; with R
    random and the same h in every block, blocks of one head give the same gates."""
    ones = [torch.ones(s, dtype=torch.float64) if j in rec else torch.zeros(s, dtype=torch.float64)
            for j, s in enumerate(shapes)]
    w = rnd(N)
    g1 = gates(w, ones)  # [4, N]
    scale = float(w.abs().sum())
    groups = [sorted(g) for g in _clusters(g1.t().contiguous(), 1e-9 * scale)]
    for grp in groups:
        if not _close(g1[:, grp], w[grp].sum().expand(4, len(grp)), scale):
            raise Refused("the recurrence does not couple the units in blocks (one per batch row and head)")
    D = len(groups[0])
    if any(len(g) != D for g in groups):
        raise Refused("the recurrence's blocks differ in size")
    groups.sort(key=lambda g: g[0])
    u = rnd(D)
    h = torch.zeros(N, dtype=torch.float64)
    for grp in groups:
        h[grp] = u
    g2 = gates(h, [rnd(s) if j in rec else torch.zeros(s, dtype=torch.float64) for j, s in enumerate(shapes)])
    sig = torch.stack([g2[:, grp].reshape(-1) for grp in groups])  # [G, 4 D]
    heads = sorted(_clusters(sig, 1e-9 * float(sig.abs().max()) + 1e-12), key=lambda c: min(c))
    B = len(heads[0])
    if any(len(c) != B for c in heads):
        raise Refused("the heads have different numbers of batch rows")
    NH = len(heads)
    pos = torch.empty(B, NH, D, dtype=torch.int64)
    for hd, members in enumerate(heads):
        for b, gi in enumerate(sorted(members)):
            pos[b, hd] = torch.tensor(groups[gi])
    v = fit(pos, 0, S)
    real = [a for a in range(3) if pos.shape[a] > 1]
    order = sorted(real, key=lambda a: -v.strides[a]) if v is not None else []
    packed = v is not None and v.offset == 0 and all(
        v.strides[order[k]] == v.strides[order[k + 1]] * v.shape[order[k + 1]] for k in range(len(order) - 1)) \
        and (not order or v.strides[order[-1]] == 1)
    if not packed:
        raise Refused("the state layout is not a reshape and permutation of [batch, head, unit]")
    return StateMap(tuple(S), B, NH, D, order)


def _decode(codes: torch.Tensor, offsets: list, sizes: list) -> tuple:
    """Index codes (1 + offset of the root + flat index; 0 = none) -> (root id, flat index) or
    None where they are not such codes."""
    if not bool((codes == codes.round()).all()):
        return None
    c = codes.round().to(torch.int64)
    rid = torch.full_like(c, -1)
    idx = torch.full_like(c, -1)
    for j, (o, s) in enumerate(zip(offsets, sizes)):
        if s == 0:
            continue
        here = (c >= o + 1) & (c <= o + s)
        rid[here] = j
        idx[here] = c[here] - o - 1
    if bool(((c != 0) & (rid < 0)).any()):
        return None
    return rid, idx


def _recurrent(gates, shapes, rec, pos, S, NH, D) -> Plan:
    """R [NH, 4, D, D] (R[h, g, j, k]: input unit k to gate g of unit j), one probe per unit k:
    recurrent roots hold index codes, h is 1 at unit k of every block."""
    N = math.prod(S)
    sizes = [math.prod(s) if j in rec else 0 for j, s in enumerate(shapes)]
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    coded = [(offsets[j] + 1 + torch.arange(sizes[j], dtype=torch.float64)).reshape(s) if j in rec
             else torch.zeros(s, dtype=torch.float64) for j, s in enumerate(shapes)]
    codes = torch.empty(NH, 4, D, D, dtype=torch.float64)
    unit = torch.zeros(N, dtype=torch.int64)
    unit[pos.reshape(-1)] = torch.arange(pos.numel()) % D
    for k in range(D):
        g = gates((unit == k).to(torch.float64), coded)[:, pos]  # [4, B, NH, D]
        if not bool((g == g[:, :1]).all()):
            raise Refused("batch rows see different recurrent weights")
        codes[:, :, :, k] = g[:, 0].permute(1, 0, 2)
    got = _decode(codes, offsets, sizes)
    if got is None or bool((got[0] < 0).any()):
        raise Refused("the recurrent weights do not enter as one entry of R per coefficient (scaled, summed or zero)")
    plan = assemble(*got, dict(enumerate(shapes)), [1, 0], zeros_ok=False)
    if plan is None:
        raise Refused("R's layout is not a view of the recurrent weights")
    return plan


def additive_tables(cell: Cell, layout: Layout, fn=None) -> dict:
    """Per additive root j: (rid, idx) tables [B, 4, NH, D] saying which entry of root j enters
    each gate position (rid = j, idx its flat index; -1 nothing), by one index-coded probe."""
    fn = fn or _probe_fn(cell)
    S = cell.shape
    shapes = [example_shape(r) for r in cell.roots]
    pos = layout.state.run(torch.arange(math.prod(S)).reshape(S), to_op=True)
    zeros = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    out = {}
    for j, s in enumerate(shapes):
        if j in layout.recurrent:
            continue
        vals = list(zeros)
        vals[j] = (1 + torch.arange(math.prod(s), dtype=torch.float64)).reshape(s)
        g = torch.stack([o.reshape(-1) for o in fn(torch.zeros(S, dtype=torch.float64), *vals)])[:, pos]
        got = _decode(g.permute(1, 0, 2, 3), [0], [math.prod(s)])
        if got is None:
            raise Refused("an input term does not enter the gates as one entry per gate (scaled or summed)")
        rid, idx = got
        out[j] = (torch.where(rid >= 0, j, -1), idx)
    return out


# ---- a symbolic batch size ------------------------------------------------------------------------

BATCH_PROOF = 1  # a symbolic batch size is proven at its example value and at that plus this


@dataclass
class BatchSize:
    """A step's symbolic batch size (dynamic shapes): the one symbolic size of its tensors, the
    leading dim of each input of the step that has it. The layouts are measured at its example
    value and proven there and at one more; the op reads the size from a root at run time."""
    symbol: object  # the sympy symbol
    hint: int


def _dims(n) -> list:
    v = val(n)
    return list(v.shape) if isinstance(v, torch.Tensor) else [v] if isinstance(v, torch.SymInt) else []


def batch_size(cells) -> BatchSize | None:
    """None where every size of the steps is static; else their batch size, or Refused where the
    symbolic sizes are more than one batch size leading every input of the step (the layouts are
    measured at one size). Inside the step a tensor may hold it anywhere: the proof runs at two
    of its values."""
    inputs = [n for c in cells for n in c.inputs]
    inside = [n for c in cells for n in c.region]
    sizes = [a for n in inside for a in n.all_input_nodes if is_size(a)]
    symbols, hint = set(), None
    for n in [*inputs, *inside, *sizes]:
        for k, d in enumerate(_dims(n)):
            if isinstance(d, int):
                continue
            symbols |= d.node.expr.free_symbols
            if n in inputs and (k or not d.node.expr.is_Symbol):
                raise Refused(f"dynamic shapes: the step's input {n.name} has the symbolic size {d} at dim {k} (only "
                              "a leading batch dim may be symbolic; compile with dynamic=False or mark the other sizes "
                              "static)")
            if d.node.expr.is_Symbol:
                hint = size_hint(d)
    if not symbols:
        return None
    if len(symbols) > 1:
        raise Refused(f"dynamic shapes: {len(symbols)} symbolic sizes ({', '.join(sorted(map(str, symbols)))}); "
                      "only one batch size may be symbolic")
    if hint is None or hint < 2:
        raise Refused("dynamic shapes: the symbolic batch size has no example value of 2 or more")
    return BatchSize(next(iter(symbols)), hint)


def leads_with(node, batch: BatchSize) -> bool:
    """The node is a tensor whose leading dim is the batch size."""
    v = val(node)
    return isinstance(v, torch.Tensor) and v.dim() > 0 and not isinstance(v.shape[0], int) \
        and v.shape[0].node.expr == batch.symbol


def check_batch_layouts(h, state: StateMap, Wx: Plan, R: Plan, b: Plan, roots, batch: BatchSize) -> None:
    """With a symbolic batch size the measured layouts must hold at every batch size: the batch
    is the outermost dim of the states (h, the step's new h), every root Wx reads is read batch row
    by batch row (_row_by_row), and R and b do not depend on it."""
    if state.B != batch.hint or not leads_with(h, batch) or (state.packed and state.packed[0] != 0):
        raise Refused("dynamic shapes: the states' batch rows are not their leading dim")
    for v in views(Wx):
        root = roots[v.root]
        if v.strides[0] == 0:
            if static_shape(root) is None:
                raise Refused("dynamic shapes: an input broadcast over the batch has a symbolic size")
            continue
        if not leads_with(root, batch) or not _row_by_row(v):
            raise Refused(f"dynamic shapes: Wx is read from {root.name} other than batch row by batch row")
    if any(static_shape(roots[v.root]) is None for plan in (R, b) for v in views(plan)):
        raise Refused("dynamic shapes: R or b has a symbolic size")


def _row_by_row(v: View) -> bool:
    """Batch row b of the view reads root row b only, at any batch size: a reshape and permutation
    with the batch outermost, or strides within one row of the root (its dims after the first)
    with the batch advancing by one row."""
    order = v.packed_order()
    if order is not None:
        return not order or order[0] == 0
    row = math.prod(v.root_shape[1:])
    reach = v.offset + sum((n - 1) * st for a, (n, st) in enumerate(zip(v.shape, v.strides)) if a)
    return v.strides[0] == row and reach < row


def proof_batches(batch: BatchSize | None) -> list:
    """The batch sizes a proof runs at: the example's (None), and one more where it is symbolic."""
    return [None] if batch is None else [None, batch.hint + BATCH_PROOF]


def state_at(state: StateMap, at: int | None) -> StateMap:
    """The state layout at batch size `at` (None: as measured)."""
    return state if at is None else replace(state, S=(at, *state.S[1:]), B=at)


def shape_at(node, batch: BatchSize | None, at: int | None) -> tuple:
    """The node's example shape, its leading batch dim at `at` where given."""
    s = example_shape(node) or ()
    return (at, *s[1:]) if at is not None and leads_with(node, batch) else s


def emit_batch_size(em, batch: BatchSize | None, nodes):
    """The batch size as a graph node (sym_size of the first of `nodes` leading with it), or None
    where it is static."""
    if batch is None:
        return None
    return em(aten.sym_size.int, next(n for n in nodes if leads_with(n, batch)), 0)


def describe_batch(batch: BatchSize | None) -> str:
    return "" if batch is None else f", batch size symbolic (proven at {batch.hint} and {batch.hint + BATCH_PROOF})"


# ---- 4. the proof -----------------------------------------------------------------------------------

def no_rule_step(Wx_t, R, b, h, c, n, m, clamp_n):
    """What code without a fresh rule computes (m' = max(i, logsigmoid(f) + m) always): the
    hypothesis the proof tells apart from the op's variants, so that such code is recognised and
    handled as the module docstring says. Not an op semantics."""
    raw = Wx_t + torch.einsum("bhk,hgjk->bghj", h, R) + b
    i, f, z, o = raw.unbind(1)
    logfm = m + torch.nn.functional.logsigmoid(f)
    m_new = torch.maximum(i, logfm)
    ig, fg = torch.exp(i - m_new), torch.exp(logfm - m_new)
    c_new = fg * c + ig * torch.tanh(z)
    n_new = fg * n + ig
    if clamp_n:
        n_new = n_new.clamp(min=1.0)
    return torch.sigmoid(o) * c_new / n_new, c_new, n_new, m_new


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _regimes(shape, dtype, gen, zero_states: bool):
    """Old states in the op's layout: rows with n > 0; rows with n == 0 among others (c != 0
    there); n == 0 everywhere; each drawn DRAWS times. m is large, so logsigmoid(f) + m > i at
    most rows: there f' > 1 at a fresh row (clamped gates show) and the code without a fresh
    rule keeps m' != i (it shows); with n small, n' = n + i' < 1 where no row is fresh (the n
    clamp shows). So every variant differs from every other in some regime (test_lowering checks)."""
    def r(lo, hi):
        return torch.rand(shape, generator=gen, dtype=dtype) * (hi - lo) + lo

    if zero_states:
        z = torch.zeros(shape, dtype=dtype)
        return [(z, z, z, z)] * DRAWS
    out = []
    for kind in ("warm", "some fresh", "all fresh") * DRAWS:
        h, c = torch.randn(shape, generator=gen, dtype=dtype) * 0.5, torch.randn(shape, generator=gen, dtype=dtype)
        m, n = r(2.0, 6.0), r(0.05, 0.6)
        if kind == "some fresh":
            mask = torch.rand(shape, generator=gen) < 0.5
            mask.view(-1)[0] = True
            if mask.numel() > 1:
                mask.view(-1)[-1] = False
            n = torch.where(mask, torch.zeros_like(n), n)
        elif kind == "all fresh":
            n = torch.zeros_like(n)
        out.append((h, c, n, m))
    return out


@dataclass
class Proof:
    agree: list  # the variants within TOL, in VARIANTS order (fresh NO_RULE: code without a rule)
    err: float  # the closest variant's max relative error


def prove(full_fn, state: StateMap, dtype, make_inputs, zero_states=False, seed=0) -> Proof:
    """Compare the step as written with reference.step for every variant. make_inputs(gen) ->
    (argument values for full_fn after the four states, Wx_t, R, b in the op's layout)."""
    gen = torch.Generator().manual_seed(seed)
    worst = {v: 0.0 for v in VARIANTS}
    for h, c, n, m in _regimes(state.op_shape, dtype, gen, zero_states):
        rest, Wx_t, R, b = make_inputs(gen)
        user = [state.run(s, to_op=False) for s in (h, c, n, m)]
        got = [state.run(o, to_op=True) for o in full_fn(*user, *rest)]
        for v in VARIANTS:
            fresh, cg, cn = v
            want = no_rule_step(Wx_t, R, b, h, c, n, m, cn) if fresh == NO_RULE else \
                reference.step(Wx_t, R, b, h, c, n, m, fresh, cg, cn)
            errs = [_rel(g, w) for g, w in zip(got, want)]
            worst[v] = max([worst[v], *(e if math.isfinite(e) else math.inf for e in errs)])
    return Proof([v for v in VARIANTS if worst[v] <= TOL], min(worst.values()))


def choose(agree: list, units: int, evidence: bool) -> tuple | None:
    """The variant among those every proof agreed with; None when the proofs could not tell two
    apart that differ. Without evidence (only the zero states the code starts from were tried)
    any agreeing variant computes what the code does. With one unit, element and batch rules are
    the same rule."""
    if not agree:
        return None
    if evidence and len(agree) > 1:
        same = units == 1 and len({(cg, cn) for _, cg, cn in agree}) == 1 and NO_RULE not in {v[0] for v in agree}
        if not same:
            return None
    return agree[0]


def random_roots(cell: Cell, layout: Layout, gen, dtype, shape=None) -> list:
    """Random values for the cell's roots and shape tensors: recurrent weights scaled by
    1/sqrt(D) so that the gates stay in the range where the variants differ. shape(node): the
    shape to draw (default: the example's)."""
    D = layout.state.D
    out = []
    for j, r in enumerate([*cell.roots, *cell.consts]):
        s = (shape or example_shape)(r) or ()
        v = val(r)
        t = torch.randn(s, generator=gen, dtype=dtype if v.is_floating_point() else torch.float32)
        out.append((t / math.sqrt(D) if j in layout.recurrent else t).to(v.dtype))
    return out


def tie_refusal(core: Core, n_old, training: bool) -> str | None:
    """Why an n clamped by clamp(n, min=1) cannot be replaced (Core.n_tie_differs): only where
    gradients flow into an old n that is not a zero constant."""
    if core.n_tie_differs and training and not is_zeros(n_old):
        return ("n' = clamp(n', min=1) gives all the gradient at n' = 1 (a fresh row) to n', "
                "xaccel.slstm's clamp (torch.maximum(n', 1)) half of it: refused in training from a given n "
                "(torch.maximum(n, torch.ones_like(n)) is the op's form)")
    return None


def describe(variant) -> str:
    fresh, cg, cn = variant
    return f"fresh={fresh}, clamp_gates={cg}, clamp_n={cn}"


# ---- emitting nodes ---------------------------------------------------------------------------------

class Emitter:
    """graph.call_function with the fake value computed (later passes read meta["val"]) and the
    user's stack trace carried (reports point at the source line)."""

    def __init__(self, graph: torch.fx.Graph, like: Node):
        self.graph = graph
        self.fake_mode = getattr(val(like), "fake_mode", None)
        self.trace = like.meta.get("stack_trace")

    def __call__(self, target, *args, **kwargs) -> Node:
        node = self.graph.call_function(target, args, kwargs)
        if self.trace:
            node.meta["stack_trace"] = self.trace
        if self.fake_mode is not None:
            with self.fake_mode:
                fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), val)
                node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node


def erase_dead(graph: torch.fx.Graph, candidates) -> None:
    """Erase the candidates left without users (latest first), except side-effecting nodes."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted((c for c in set(candidates) if c in order), key=order.__getitem__, reverse=True):
        if not n.users and n.op == "call_function" and not n.is_impure():
            graph.erase_node(n)
