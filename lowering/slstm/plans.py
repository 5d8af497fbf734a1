"""Plans: how each of the op's tensors (Wx, R, b) is made from the step's roots, as views (a reshape
and permutation where the measured map is one, as_strided otherwise), stacks, sums and zeros; run
on real tensors for the proof and emitted as graph nodes for the rewrite. And the StateMap: the
user's state layout against the op's [B, NH, D]. measure.py builds them from index-coded probes:
`fit` finds the view whose entries are a table of flat root indices, `assemble` and `plan_of`
stack and sum views where one does not cover the tensor."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .nodes import aten, val


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


def with_batch(sizes, axes, batch) -> list:
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
                ops.append((aten.reshape.default, (with_batch(sizes, order, batch),)))
            perm = [order.index(a) for a in real]
            if perm != sorted(perm):
                ops.append((aten.permute.default, (perm,)))
        else:  # (with a symbolic batch: batch.check_batch_layouts allows this only batch row by batch row)
            ops.append((aten.reshape.default, ([-1],)))
            if self.offset:
                ops.append((aten.slice.Tensor, (0, self.offset) if batch is not None else (0, self.offset, numel)))
            ops.append((aten.as_strided.default, (with_batch([self.shape[a] for a in real], real, batch),
                                                  [self.strides[a] for a in real])))
        axes = range(len(self.shape))
        full = [n if a in real else 1 for a, n in enumerate(self.shape)]
        if batch is not None or full != [self.shape[a] for a in real]:
            ops.append((aten.reshape.default, (with_batch(full, axes, batch if 0 in real else None),)))
        if full != list(self.shape):
            ops.append((aten.expand.default, (with_batch(self.shape, axes, batch),)))
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
        return like.new_zeros(with_batch(self.shape, range(len(self.shape)), batch))

    def emit(self, em, nodes, like, batch=None):
        v = val(like)
        return em(aten.zeros.default, with_batch(self.shape, range(len(self.shape)), batch), dtype=v.dtype,
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


def earlier(plan: Plan, stride: dict) -> Plan | None:
    """The plan one step earlier: each view reads root j stride[j] entries before (None where that
    is before the root's first entry)."""
    if isinstance(plan, View):
        offset = plan.offset - stride.get(plan.root, 0)
        return None if offset < 0 else replace(plan, offset=offset)
    if isinstance(plan, (Stack, Sum)):
        parts = [earlier(p, stride) for p in plan.parts]
        return None if None in parts else replace(plan, parts=parts)
    return plan


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
        batch size where it is symbolic (the user's dim 0 then, see batch.py)."""
        sizes = with_batch([self.op_shape[a] for a in self.packed], self.packed, batch)
        op_shape = with_batch(self.op_shape, range(3), batch)
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
        sizes = with_batch([self.op_shape[a] for a in real], real, batch)
        S = with_batch(self.S, range(len(self.S)), batch)
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
