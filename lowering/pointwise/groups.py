"""Rest pass "pointwise": in a graph that xaccel runs eagerly (an inference graph, aot_autograd's
forward and backward graphs), each group of elementwise ops becomes one xaccel.pointwise call:
one kernel reads the group's inputs once and writes only the values read outside the group,
where eager runs one kernel per op, each reading and writing a whole tensor (a model's gated
activations, residual and skip terms, and in the backward the products and activation gradients
around every xaccel op: memory traffic and launches the eager rest otherwise pays for).

A group is two or more ops of the elementwise table (ops/gemm_epilogue/elementwise.py: activations,
add/sub/mul/div, activation gradients) connected by data flow, whose values share one static shape,
dtype and device (CUDA, or Triton's interpreter), with at least MIN_ELEMENTS elements (below that
a fused launch costs more host time than the ops' GPU time: decode steps stay as they are). Their
other inputs are tensors of the group's dtype broadcastable to its shape, 0-d tensors, or numbers.
Nothing written in place joins a group. A group must fit in the graph as one call: every input
computed before every read of a group value from outside (else the op joins another group or
starts its own).

Runs on graphs that already have no autograd, so the op needs no backward; the replacements join
the compile's report noted with the graph they were found in.
"""
from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from torch_xaccel import runtime
from torch_xaccel.ops.gemm_epilogue import elementwise
from torch_xaccel.ops.pointwise.program import DTYPES, Program
from torch_xaccel.report import Fallback, GraphReport, Replacement

from ..graph_utils import location, mutated_nodes, val

FAMILY = "pointwise"
MIN_ELEMENTS = 1 << 16
aten = torch.ops.aten
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass
class _Op:
    node: torch.fx.Node
    name: str  # the elementwise table's
    args: list  # the IR's inputs in order: nodes and numbers


@dataclass
class _Group:
    ops: list[_Op] = field(default_factory=list)

    @property
    def nodes(self) -> set:
        return {o.node for o in self.ops}


def _arguments(node: torch.fx.Node, name: str) -> list | None:
    """The op's inputs in the IR's order (rsub swapped), or None where a keyword or argument is
    one the fused op does not model."""
    entry = elementwise.BY_NAME[name]
    kwargs = dict(node.kwargs)
    if kwargs.pop("alpha", 1) != 1:
        return None
    kwargs.pop("approximate", None)  # (gelu's: from_aten told the two apart)
    if entry.kind == "unary":
        args = list(node.args[:1])
    else:
        args = list(node.args[:2])
        if name == "relu_grad" and (node.args[2] if len(node.args) > 2 else kwargs.pop("threshold", None)) != 0:
            return None
        kwargs.pop("threshold", None)
    if kwargs or len(args) != (1 if entry.kind == "unary" else 2):
        return None
    if node.target == aten.rsub.Scalar:  # rsub(x, y) = y - x
        args.reverse()
    if entry.kind == "grad" and not all(isinstance(a, torch.fx.Node) for a in args):
        return None
    return args


def _fusable(node: torch.fx.Node, written: set) -> _Op | None:
    """The node as a group member, or None."""
    if node.op != "call_function" or not elementwise.takes(node.target) or node in written:
        return None
    entry = elementwise.from_aten(node.target, node.args, node.kwargs)
    v = val(node)
    if entry is None or not isinstance(v, torch.Tensor) or v.dtype not in _DTYPE_NAMES:
        return None
    if not all(isinstance(s, int) for s in v.shape) or v.numel() < MIN_ELEMENTS or v.numel() >= 2 ** 31:
        return None
    if not (v.device.type == "cuda" or runtime.interpreting()):
        return None
    args = _arguments(node, entry.name)
    if args is None:
        return None
    for a in args:
        if isinstance(a, torch.fx.Node):
            av = val(a)
            if not isinstance(av, torch.Tensor) or a in written or av.device != v.device:
                return None
            if av.dim() and av.dtype != v.dtype or not av.dtype.is_floating_point:
                return None
            if not all(isinstance(s, int) for s in av.shape) or av.dim() > v.dim() or any(
                    s not in (1, t) for s, t in zip(reversed(av.shape), reversed(v.shape))):
                return None
        elif isinstance(a, bool) or not isinstance(a, numbers.Real):
            return None
    return _Op(node, entry.name, args)


def _same_kind(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = val(a), val(b)
    return tuple(va.shape) == tuple(vb.shape) and va.dtype == vb.dtype and va.device == vb.device


def _placeable(ops: list[_Op], pos: dict) -> bool:
    """Whether the group can run as one call: every input computed before every outside read of
    a group value (the call then goes right after its last input)."""
    inside = {o.node for o in ops}
    last_input = max((pos[a] for o in ops for a in o.args if isinstance(a, torch.fx.Node) and a not in inside),
                     default=-1)
    return all(pos[u] > last_input for o in ops for u in o.node.users if u not in inside)


def find_groups(graph: torch.fx.Graph, refused: frozenset = frozenset()) -> list[_Group]:
    """Groups in graph order: each op joins its producers' groups where the union stays placeable,
    else the largest producer group that does, else starts its own. Ops of `refused` groups stay out."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    written = mutated_nodes(graph)
    group_of: dict = {}
    for node in nodes:
        op = None if node in refused else _fusable(node, written)
        if op is None:
            continue
        producers = []
        for a in op.args:
            g = group_of.get(a) if isinstance(a, torch.fx.Node) else None
            if g is not None and g not in producers and _same_kind(a, node):
                producers.append(g)
        largest_first = sorted(producers, key=lambda g: -len(g.ops))
        options = ([producers] if len(producers) > 1 else []) + [[g] for g in largest_first]
        joined = None
        for option in options:
            ops = sorted([o for g in option for o in g.ops] + [op], key=lambda o: pos[o.node])
            if _placeable(ops, pos):
                joined = _Group(ops)
                for g in option:
                    for o in g.ops:
                        group_of[o.node] = joined
                break
        group_of[node] = joined or _Group([op])
    unique = {id(g): g for g in group_of.values()}
    return sorted((g for g in unique.values() if len(g.ops) >= 2), key=lambda g: pos[g.ops[0].node])


def _program(group: _Group) -> tuple[Program, list, list]:
    """(program, input nodes, output nodes) of a group."""
    inside = group.nodes
    inputs: list = []
    nodes: list[dict] = []
    index: dict = {}
    for o in group.ops:
        ins = []
        for a in o.args:
            if isinstance(a, torch.fx.Node) and a in index:
                ins.append(index[a])
                continue
            if isinstance(a, torch.fx.Node):
                nodes.append({"op": "load", "operand": len(inputs), "bcast": "full"})
                inputs.append(a)
                index[a] = len(nodes) - 1
            else:
                nodes.append({"op": "const", "value": float(a)})
            ins.append(len(nodes) - 1)
        nodes.append({"op": o.name, "in": ins})
        index[o.node] = len(nodes) - 1
    outputs = [o.node for o in group.ops if any(u not in inside for u in o.node.users)]
    first = val(group.ops[0].node)
    program = Program(tuple(nodes), tuple(index[n] for n in outputs), tuple(first.shape),
                      tuple(tuple(val(n).stride()) for n in outputs), _DTYPE_NAMES[first.dtype])
    program.validate()
    return program, inputs, outputs


def _replace(graph: torch.fx.Graph, group: _Group, program: Program, inputs: list, outputs: list) -> None:
    """The call right after its last input (and after the placeholders), where a later group
    finds its outputs as early as they can be."""
    inside = group.nodes
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    after = max([pos[a] for a in inputs] + [pos[n] for n in graph.find_nodes(op="placeholder")], default=-1)
    with graph.inserting_before(nodes[after + 1]):  # (inserting_after would reverse the new nodes)
        fused = graph.call_function(torch.ops.xaccel.pointwise.default, (inputs, program.to_json()))
        fused.meta["val"] = [val(n) for n in outputs]
        for k, n in enumerate(outputs):
            item = graph.call_function(operator.getitem, (fused, k))
            item.meta["val"] = val(n)
            n.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
    for o in reversed(group.ops):
        graph.erase_node(o.node)


def _kernel_refusal(program: Program, inputs: list) -> str | None:
    """Why the kernel would not run the group (its call would run the fp32 reference, slower than
    the ops as written), or None."""
    try:
        from torch_xaccel.codegen.pointwise import layout_refusal
    except ImportError:  # (no Triton: the runtime's fallback names that at the call)
        return None
    return layout_refusal(program, [(val(a).shape, val(a).stride()) for a in inputs])


def run(gm: torch.fx.GraphModule, report: GraphReport, graph_name: str) -> int:
    """Fuse the graph's groups; the replacements join `report`, noted with `graph_name`
    ("forward", "backward", "inference"). Returns how many groups were fused. One group at a
    time, the next found in the graph as the last left it: a fused group's outputs exist from its
    call on, which decides where a group reading them can go."""
    groups, refused = [], frozenset()
    while found := find_groups(gm.graph, refused):
        group = found[0]
        program, inputs, outputs = _program(group)
        where = location(group.ops[0].node)
        why = _kernel_refusal(program, inputs)
        if why is not None:
            refused |= group.nodes
            report.fallbacks.append(Fallback(FAMILY, f"{len(group.ops)} elementwise ops left as written: {why}",
                                             where))
            continue
        groups.append(group)
        _replace(gm.graph, group, program, inputs, outputs)
        report.replacements.append(Replacement(
            FAMILY, "xaccel.pointwise",
            f"{len(group.ops)} elementwise ops over {list(program.shape)} {program.dtype}: {program.describe()} "
            f"({len(inputs)} inputs, {len(outputs)} outputs)", where, note=graph_name))
    if groups:
        gm.graph.lint()
        gm.recompile()
    return len(groups)
