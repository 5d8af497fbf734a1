"""The replaced regions of a lowered graph, each as replaced and as the user wrote it, so that a
region can be measured against its original and put back where the original is faster.

Before the passes every node of the ATen graph gets an id (`tag`), and a copy of the graph is kept.
After them, a node of the lowered graph whose id and target are those of an original node is a
survivor; every other node belongs to a replacement (an xaccel op and the views, getitems and
casts around it), and connected ones form one region. A region's original is found through its
readers: a survivor (or the output) that reads a region node read, in the original graph, values
that the passes erased; those values, and the erased nodes they come from back to survivors, are
the region as written. Nothing here knows a family: any pass's replacement is a region.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.fx

from torch_xaccel.lowering.proof import extract

ORIGIN = "xaccel_origin"


def tag(gm: torch.fx.GraphModule) -> None:
    for i, node in enumerate(gm.graph.nodes):
        node.meta[ORIGIN] = i


def snapshot(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a tagged graph (the nodes' metadata copied shallowly, ids included) that the
    passes do not touch."""
    graph = torch.fx.Graph(tracer_cls=gm.graph._tracer_cls)
    out = graph.graph_copy(gm.graph, {})
    node = graph.output(out)
    node.meta[ORIGIN] = gm.graph.find_nodes(op="output")[0].meta[ORIGIN]
    return torch.fx.GraphModule(gm, graph)


def _is_xaccel(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith("xaccel.")


@dataclass
class Region:
    new: list  # the lowered graph's nodes of the replacement, in graph order
    readers: list  # surviving lowered nodes (or the output) reading them
    ops: list = field(default_factory=list)  # the xaccel ops' names

    @property
    def label(self) -> str:
        """e.g. "mlstm", "gemm_epilogue x2" (ops whose values feed one another are one region)."""
        counts = {op: self.ops.count(op) for op in self.ops}
        return "+".join(f"{op} x{n}" if n > 1 else op for op, n in counts.items())


class Replacements:
    """Which new node took which node's place, as the passes say it (fx's replace hook fires on
    every `replace_all_uses_with` / `replace_input_with`): the boundaries between regions. A value
    an op's output replaced is the original's value, so the regions on either side of it can be
    measured and put back one by one."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm, self.events = gm, []
        self._hook = lambda old, new, user: self.events.append((old, old.meta.get(ORIGIN), old.target, new))

    def __enter__(self):
        if hasattr(self.gm, "_register_replace_node_hook"):  # (without it regions merge at boundaries)
            self.gm._register_replace_node_hook(self._hook)
        return self

    def __exit__(self, *exc):
        if hasattr(self.gm, "_unregister_replace_node_hook"):
            self.gm._unregister_replace_node_hook(self._hook)


class Diff:
    """The lowered graph against its original: survivors, regions, and how to put a region back."""

    def __init__(self, original: torch.fx.GraphModule, lowered: torch.fx.GraphModule,
                 replacements: Replacements | None = None):
        self.original, self.lowered = original, lowered
        self.orig_by_id = {n.meta[ORIGIN]: n for n in original.graph.nodes if ORIGIN in n.meta}
        seen: dict = {}
        for n in lowered.graph.nodes:
            i = n.meta.get(ORIGIN)
            o = self.orig_by_id.get(i)
            if o is not None and o.op == n.op and o.target == n.target and i not in seen:
                seen[i] = n
        self.survivor = seen  # id -> lowered node
        self.survivor_ids = {n: i for i, n in seen.items()}
        self.equiv = self._equivalents(replacements.events if replacements else [])  # new node -> original id
        self.regions = self._regions()

    def _equivalents(self, events) -> dict:
        """new lowered node -> the id of the original node whose value it holds (it replaced that
        node, or a node that had replaced it)."""
        by_name = {n.name: n for n in self.lowered.graph.nodes}
        held: dict = {}  # node (any, at its event) -> original id
        for old, origin, target, new_name in events:
            orig = self.orig_by_id.get(origin)
            i = origin if orig is not None and orig.target == target else held.get(old)
            new = by_name.get(new_name)
            if i is not None and new is not None and new is not old:
                held[new] = i
        alive = set(by_name.values())
        return {n: i for n, i in held.items() if n in alive and n not in self.survivor_ids}

    def _regions(self) -> list[Region]:
        new = [n for n in self.lowered.graph.nodes if n.op == "call_function" and n not in self.survivor_ids]
        new_set, parent = set(new), {n: n for n in new}

        def find(n):
            while parent[n] is not n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n
        for n in new:
            for a in n.all_input_nodes:
                if a in new_set and a not in self.equiv:  # a value that replaced an original's: a boundary
                    parent[find(a)] = find(n)
        groups: dict = {}
        for n in new:
            groups.setdefault(find(n), []).append(n)
        regions = []
        for nodes in groups.values():
            ops = [str(n.target).split(".")[1] for n in nodes if _is_xaccel(n)]
            if not ops:
                continue
            inside = set(nodes)
            readers = list(dict.fromkeys(u for n in nodes for u in n.users if u not in inside))
            regions.append(Region(nodes, readers, ops))
        return regions

    def _holds(self, node, orig: torch.fx.Node) -> bool:
        """Whether a lowered node holds the original node's value (it is its survivor, or it
        replaced it)."""
        i = orig.meta.get(ORIGIN)
        return self.survivor.get(i) is node or (i is not None and self.equiv.get(node) == i)

    def original_values(self, region: Region) -> list | None:
        """(reader, region node, original node) for each place a reader reads the region: the
        original node whose value it read there before the passes (a reader in another region reads
        a boundary value, whose original is known); None when a reader changed beyond the region."""
        inside = set(region.new)
        values = []
        for reader in region.readers:
            if reader.op == "call_function" and reader not in self.survivor_ids:  # another region's
                for a in reader.all_input_nodes:
                    if a in inside:
                        if a not in self.equiv:
                            return None
                        values.append((reader, a, self.orig_by_id[self.equiv[a]]))
                continue
            orig = self.orig_by_id.get(self.survivor_ids.get(reader)) if reader.op != "output" else \
                self.original.graph.find_nodes(op="output")[0]
            if orig is None:
                return None
            now, before = _flat_args(reader), _flat_args(orig)
            if len(now) != len(before):
                return None
            for a, b in zip(now, before):
                if isinstance(a, torch.fx.Node) and a in inside:
                    if not isinstance(b, torch.fx.Node):
                        return None
                    values.append((reader, a, b))
                elif isinstance(a, torch.fx.Node) != isinstance(b, torch.fx.Node):
                    return None
                elif isinstance(a, torch.fx.Node) and not self._holds(a, b):
                    return None  # the reader changed in another way: not this region's to put back
                elif not isinstance(a, torch.fx.Node) and not _same_constant(a, b):
                    return None
        return values

    def revert(self, regions: list[Region]) -> torch.fx.GraphModule | None:
        """A copy of the lowered graph with `regions` put back as written, or None when one cannot
        be (its readers changed beyond it, or the original's nodes would not fit the order)."""
        graph = torch.fx.Graph(tracer_cls=self.lowered.graph._tracer_cls)
        env: dict = {}
        out = graph.graph_copy(self.lowered.graph, env)
        graph.output(out)
        made: dict = {}
        reverted = {n for r in regions for n in r.new}
        available = {i: n for n, i in self.equiv.items() if n not in reverted}

        def resolve(orig: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node:
            i = orig.meta.get(ORIGIN)
            if i in self.survivor:
                return env[self.survivor[i]]
            if orig in made:
                return made[orig]
            if i in available:
                return env[available[i]]
            with graph.inserting_before(before):
                made[orig] = graph.node_copy(orig, lambda a: resolve(a, before))
            return made[orig]

        order = sorted(regions, key=lambda r: _position(self.lowered.graph)(r.new[0]))
        for region in order:
            values = self.original_values(region)
            if values is None:
                return None
            position = _position(graph)
            first = min((env[r] if r.op != "output" else graph.find_nodes(op="output")[0] for r in region.readers),
                        key=position)
            for reader, now, orig in values:
                target = env[reader] if reader.op != "output" else graph.find_nodes(op="output")[0]
                target.replace_input_with(env[now], resolve(orig, first))
        for region in reversed(order):
            for n in reversed(region.new):
                copy = env[n]
                if not copy.users:
                    graph.erase_node(copy)
        try:
            graph.lint()
        except Exception:  # noqa: BLE001 - the original's nodes do not fit where the readers are
            return None
        gm = torch.fx.GraphModule(self.lowered, graph)
        gm.meta.update(self.lowered.meta)
        return gm

    def sides(self, region: Region) -> Sides | None:
        """The region on its own, as replaced and as written, over the survivors they read (by id:
        both read the same values), or None when it cannot be cut out."""
        values = self.original_values(region)
        if not values:
            return None
        inside = set(region.new)
        new_inputs = list(dict.fromkeys(a for n in region.new for a in n.all_input_nodes if a not in inside))
        if any(a not in self.survivor_ids and a not in self.equiv for a in new_inputs):
            return None
        # a value another region's replacement holds is an input here (the boundary between them);
        # one this region's own nodes hold is computed here, as written
        held_outside = {i for n, i in self.equiv.items() if n not in inside}
        order = {n: i for i, n in enumerate(self.original.graph.nodes)}
        erased, old_inputs, todo = set(), {}, [orig for _, _, orig in values]
        while todo:
            n = todo.pop()
            if n in erased or n in old_inputs:
                continue
            i = n.meta.get(ORIGIN)
            if i in self.survivor or i in held_outside:
                old_inputs[n] = None
            elif n.op in ("placeholder", "output"):
                return None
            else:
                erased.add(n)
                todo.extend(n.all_input_nodes)
        old_inputs = sorted(old_inputs, key=order.get)
        replaced, _ = extract(region.new, new_inputs, outputs=[now for _, now, _ in values])
        written, _ = extract(sorted(erased, key=order.get), old_inputs, outputs=[orig for _, _, orig in values])
        return Sides(replaced, written, [self.survivor_ids.get(a, self.equiv.get(a)) for a in new_inputs],
                     [a.meta[ORIGIN] for a in old_inputs])

    def signature(self, region: Region) -> str:
        """Regions with the same code at the same shapes (the layers of a stack) share one
        measurement: the ops' targets, arguments' shapes and dtypes and constants."""
        h = hashlib.sha256()
        for n in region.new:
            h.update(str(n.target).encode())
            for a in _flat_args(n):
                val = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
                if isinstance(val, torch.Tensor):
                    h.update(f"{tuple(val.shape)}{val.dtype}{val.stride()}".encode())
                elif not isinstance(a, torch.fx.Node):
                    h.update(repr(a).encode())
        return h.hexdigest()[:24]


@dataclass
class Sides:
    replaced: torch.fx.GraphModule  # the region's nodes: its inputs -> the values its readers read
    written: torch.fx.GraphModule  # the original's erased nodes: its inputs -> the same values
    replaced_inputs: list  # the ids of the survivors each reads, in placeholder order
    written_inputs: list


def capture(original: torch.fx.GraphModule, ids: set, args) -> dict:
    """{id: value} of the original graph's nodes with those ids, running it on args."""
    wanted = {n: n.meta[ORIGIN] for n in original.graph.nodes if n.meta.get(ORIGIN) in ids}
    seen: dict = {}

    class Capture(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n in wanted:
                seen[wanted[n]] = out.detach() if isinstance(out, torch.Tensor) else out
            return out
    with torch.no_grad():
        Capture(original).run(*args)
    return seen


def _same_constant(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - (a tensor constant, a symbolic value): not provably the same
        return False


def _flat_args(node: torch.fx.Node) -> list:
    import torch.utils._pytree as pytree

    return pytree.tree_leaves((node.args, node.kwargs))


def _position(graph: torch.fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]
