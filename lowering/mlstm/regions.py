"""mLSTM-shaped regions of an ATen graph, found by data flow and shapes (no file or function names).

An mLSTM keeps every tensor it computes in the heads-first layout [B, NH, ...]: gates [B, NH, S]
(or [B, NH, S, 1], or per chunk [B, NH, NC, L]), q k^T [B, NH, S, S], states [B, NH, DK, DV],
h [B, NH, S, DV]; the model around it leaves that layout (h.transpose(1, 2) before the output
projection). A region grows from a seed, the log-sigmoid of a forget gate:
1. forward: every user of a region node that is a tensor in the seed's [B, NH] layout; a store into
   a buffer created in the graph (chunk states written into a zeros tensor) brings in the buffer
   and its views, whose readers follow;
2. backward: each input of a region node that is computed from region-layout tensors alone (q
   scaled, k transposed, a time slice q[:, :, t]), a constant (ones, tril, zeros start states,
   sizes), or a size of any tensor; what stays outside is where the layout starts (q after the
   heads transpose, a graph input): the region's inputs;
3. in-place writes into buffers the region itself created (chunk states stored into a zeros
   tensor) join it; a constant that anything outside also reads (a cache tensor the model writes
   back into) is an input instead.
Which inputs are q, k, v, i, f and the start states, and which nodes are h and the final states,
the numeric proof decides (provenance.py); a region can be larger than the mLSTM (a silu(h) in the
same layout), and the proof cuts it back to what it can prove.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graph_utils import alias_base, reported_with_region, val
from .matching import is_op

aten = torch.ops.aten
_SIZES = (aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int)


@dataclass
class Region:
    nodes: list = field(default_factory=list)        # graph order
    inputs: list = field(default_factory=list)       # tensors (and floats) read from outside, first use order
    size_inputs: set = field(default_factory=set)    # inputs read only for their sizes


# in-place by schema, but they change no value (torch.tensor(c) in user code traces as
# lift_fresh_copy then detach_)
_VALUE_PRESERVING = (aten.detach_.default,)


def writes(node) -> list:
    """The arguments a node writes in place."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable or node.target in _VALUE_PRESERVING:
        return []
    out = []
    for k, arg_schema in enumerate(schema.arguments):
        arg = node.args[k] if k < len(node.args) else node.kwargs.get(arg_schema.name)
        if arg_schema.alias_info is not None and arg_schema.alias_info.is_write and isinstance(arg, torch.fx.Node):
            out.append(arg)
    return out


def _tensors(v) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in _tensors(x)]
    return []


def _in_layout(node, lead) -> bool:
    ts = _tensors(val(node))
    return bool(ts) and all(t.dim() >= 2 and statically_known_true(t.shape[0] == lead[0])
                            and statically_known_true(t.shape[1] == lead[1]) for t in ts)


def sizey(node) -> bool:
    """A size computation (sym_size, int arithmetic on sizes): its value does not depend on data."""
    return node.op == "call_function" and (node.target in _SIZES or not _tensors(val(node)))


class Constants:
    """Whether a node's value depends on no graph input except through sizes (memoised)."""

    def __init__(self):
        self.memo: dict = {}

    def __call__(self, node) -> bool:
        if node in self.memo:
            return self.memo[node]
        self.memo[node] = False  # cycles cannot occur; this only stops re-entry
        ok = isinstance(val(node), torch.SymInt) or node.op == "get_attr" or node.op == "call_function" and (
            not writes(node) and (node.target in _SIZES or all(self(a) for a in node.all_input_nodes)))
        self.memo[node] = ok
        return ok


def grow(graph: torch.fx.Graph, seed: torch.fx.Node) -> Region | None:
    """The region around one seed (None: the seed is not in a heads-first layout)."""
    t = val(seed)
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        return None
    lead = (t.shape[0], t.shape[1])
    constant = Constants()
    held_out: set = set()  # bases of constants the rest of the graph also reads (step 3)
    region = {seed}
    todo = [seed]
    family = _alias_families(graph)
    while todo:  # 1. forward, in the layout
        for u in todo.pop().users:
            if u in region or u.op != "call_function" or not _in_layout(u, lead):
                continue
            if writes(u):  # a store into a buffer the region creates: what reads the buffer follows
                base = alias_base(writes(u)[0])
                if not constant(base):
                    continue
                joined = [u, base, *family.get(base, ())]
            else:
                joined = [u]
            for n in joined:
                if n not in region:
                    region.add(n)
                    todo.append(n)
    while True:
        _absorb(graph, region, lead, constant, held_out)
        if not _release_shared_constants(region, constant, held_out):
            break
    order = {n: k for k, n in enumerate(graph.nodes)}
    nodes = sorted(region, key=order.__getitem__)
    inputs, readers = [], {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in region:
                if a not in readers:
                    inputs.append(a)
                readers.setdefault(a, []).append(n)
    sizes = {a for a, rs in readers.items() if all(r.target in _SIZES for r in rs)}
    return Region(nodes, inputs, sizes)


def _absorb(graph, region: set, lead, constant, held_out: set) -> None:
    """Steps 2 and 3 until nothing joins."""
    changed = True
    while changed:
        changed = False
        for n in list(region):  # 2. backward
            for a in n.all_input_nodes:
                if a not in region and alias_base(a) not in held_out and _absorbable(a, lead, constant):
                    region.add(a)
                    changed = True
        for n in graph.nodes:  # 3. writes into the region's own buffers, with their views
            if n in region or not writes(n):
                continue
            chain = _view_chain(n)
            base = alias_base(writes(n)[0])
            if base in region and base not in held_out and all(a in region or a in chain for a in n.all_input_nodes):
                region.update(chain)
                region.add(n)
                changed = True


def _absorbable(a, lead, constant) -> bool:
    if a.op == "get_attr":  # a tensor constant of the user's code (torch.tensor(-inf))
        return True
    if a.op != "call_function" or writes(a):
        return False
    if sizey(a) or constant(a):
        return True
    if not _in_layout(a, lead):
        return False
    ins = [x for x in a.all_input_nodes if isinstance(val(x), torch.Tensor)]
    # computed from region-layout tensors (or constants) only, and from at least one of them: the
    # node where the layout starts (a transpose of [B, S, NH, D]) stays outside
    return bool(ins) and all(_in_layout(x, lead) or constant(x) for x in ins) and any(_in_layout(x, lead) for x in ins)


def _alias_families(graph) -> dict:
    """base -> the views of it."""
    out: dict = {}
    for n in graph.nodes:
        base = alias_base(n)
        if base is not n:
            out.setdefault(base, []).append(n)
    return out


def _view_chain(write) -> list:
    """The view nodes between an in-place write's target and its base."""
    chain, n = [], writes(write)[0]
    while alias_base(n) is not n:
        chain.append(n)
        n = n.args[0]
    return chain


def _release_shared_constants(region: set, constant, held_out: set) -> bool:
    """Constants (and their views and writes) that a node outside the region also reads or writes
    become inputs: the region must not own a buffer the rest of the graph sees (a cache the model
    writes the final states back into). True if any did."""
    released = False
    families: dict = {}
    for m in region:
        families.setdefault(alias_base(m), []).append(m)
    bases = {alias_base(n) for n in region if constant(n) and not sizey(n)}
    for base in bases:
        if base in held_out:
            continue
        family = families.get(base, [])
        # a view read outside may be a result (the final state sliced from the chunk states); the
        # buffer itself read outside, or any write from outside, is shared
        read = any(u not in region and u.target not in _SIZES for u in base.users) if base in region else False
        if read or any(u not in region and writes(u) for m in family for u in m.users):
            held_out.add(base)
            region.difference_update({m for m in region if alias_base(m) is base
                                      or any(alias_base(w) is base for w in writes(m))})
            released = True
    return released


def seeds(graph: torch.fx.Graph) -> list:
    """What makes code look like an mLSTM: a log-sigmoid (of a forget gate) that no earlier pass
    has already reported as part of its own refused region (an sLSTM look-alike)."""
    return [n for n in graph.nodes if is_op(n, aten.log_sigmoid.default) and not reported_with_region(n)]
