"""Small helpers over ATen FX graphs shared by the pattern passes."""
from __future__ import annotations

import re

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from torch_xaccel.substitutions import FILE_MARK


def val(node) -> object:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def same_shape(s1, s2) -> bool:
    """True only when the shapes are provably equal; never adds a guard on symbolic sizes."""
    return len(s1) == len(s2) and all(statically_known_true(a == b) for a, b in zip(s1, s2))


def is_one(size) -> bool:
    return statically_known_true(size == 1)


def frames(node: torch.fx.Node) -> list[tuple[str, str, str]]:
    """(path, line, function) of each frame in the node's user stack trace, outermost first."""
    return re.findall(r'File "([^"]+)", line (\d+), in (\S+)', node.meta.get("stack_trace") or "")


def location(node: torch.fx.Node) -> str:
    """'file.py:42 in forward' from the user's stack trace, or the node name. Frames inside
    torch_xaccel/substitutions.py (a substituted library function) are skipped: the caller is the news."""
    user = [f for f in frames(node) if not f[0].endswith(FILE_MARK)]
    if not user:
        return node.name
    path, line, fn = user[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line} in {fn}"


def _is_view(target) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


def mutated_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes whose value is written in place somewhere in the graph, directly or through a view.

    A chain may not fuse across such a value: the fused op would read it before the write."""
    written: set[torch.fx.Node] = set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for i, arg_schema in enumerate(schema.arguments):
            arg = node.args[i] if i < len(node.args) else node.kwargs.get(arg_schema.name)
            if arg_schema.alias_info is not None and arg_schema.alias_info.is_write and isinstance(arg, torch.fx.Node):
                written.add(arg)
    todo = list(written)
    while todo:  # a write through a view writes its base too
        n = todo.pop()
        if n.op == "call_function" and _is_view(n.target) and isinstance(n.args[0], torch.fx.Node):
            base = n.args[0]
            if base not in written:
                written.add(base)
                todo.append(base)
    return written
