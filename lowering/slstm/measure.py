"""Measuring a step's layouts: its pre-activation (h and the roots -> the four gates) runs on
structured float64 inputs, and what comes out says
- which roots add to the gates (Wx, b) and which multiply h (R), and that the gates are
  Wx_t + R h + b (affine in h for fixed weights);
- which state positions form one (batch, head) block (one probe, R = 1) and which blocks share a
  head (one probe, the same h in every block): the StateMap;
- R's entries, by index-coded probes, one per unit (R [NH, 4, D, D]);
- each additive root's entry at each gate position, by one index-coded probe per root.
These become Plans (plans.py), views from the roots to the op's layouts. A code entry that is not
one root entry (scaled, summed) is refused: the op's tensors are views of the user's."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..proof import Refused
from .cell import Cell, extract
from .nodes import example_shape, val
from .plans import Plan, StateMap, assemble, fit

MAX_UNITS = 1024  # R is measured with one probe per unit of a head


@contextlib.contextmanager
def running(what: str):
    """Measuring and proving run the user's nodes on real tensors (outside any fake mode): an
    error there means the code is not replaced, never that the compile fails. They run on one
    thread: the tensors are a few hundred numbers, and waking a thread pool for each op costs more
    than the op (milliseconds per call on a busy machine)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with unset_fake_temporarily():
            yield
    except Refused:
        raise
    except Exception as e:  # noqa: BLE001 - a step we cannot run is a step we do not replace
        raise Refused(f"could not run {what} for the proof ({type(e).__name__}: {e})") from e
    finally:
        torch.set_num_threads(threads)


@dataclass
class Layout:
    state: StateMap
    recurrent: list  # root indices that multiply h
    R: Plan  # [NH, 4, D, D] from the recurrent roots
    additive: dict = field(default_factory=dict)  # root index -> (rid, idx) tables [B, 4, NH, D]


def _probe_fn(cell: Cell):
    """The pre-activation as a function (h, *roots) -> the four gates, in float64."""
    gates = [cell.core.gates[g] for g in "ifzo"]
    return extract(cell.pre, [cell.h_old, *cell.roots], gates, dtype=torch.float64)


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
    """The layouts, from probes of the pre-activation in float64 (the module docstring says which)."""
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
