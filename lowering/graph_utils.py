"""Small helpers over ATen FX graphs shared by the pattern passes."""
from __future__ import annotations

import os
import re

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

# library functions substituted while Dynamo traces live in this package's passes: their frames in
# a node's stack trace are not the user's
_LOWERING_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


# node meta key: a pass reported the region this node belongs to as one refusal (an mLSTM look-alike
# that failed its proof); other passes do not report the node again
REPORTED_REGION = "xaccel_reported_region"


def reported_with_region(node) -> bool:
    return REPORTED_REGION in node.meta


def val(node) -> object:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def is_op(node, *targets) -> bool:
    """A call of one of `targets`."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def named_arguments(node: torch.fx.Node) -> dict | None:
    """An op node's arguments by their schema names, defaults filled in (None where the target has
    no schema that binds them), however the call spelled them (positions or keywords)."""
    from torch.fx.operator_schemas import normalize_function

    bound = normalize_function(node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    return None if bound is None else bound.kwargs


def retarget(node: torch.fx.Node, target) -> bool:
    """Point an op node at another op with the same arguments and its first outputs unchanged (a
    variant returning more), recomputing its fake value; False (node untouched) where the node has
    no fake value to recompute it from."""
    if _fake_mode(node) is None:
        return False
    node.target = target
    return refake(node)


def _fake_mode(node: torch.fx.Node):
    fake = node.meta.get("val")
    first = fake[0] if isinstance(fake, (tuple, list)) and fake else fake
    return getattr(first, "fake_mode", None)


def refake(node: torch.fx.Node) -> bool:
    """Recompute a node's fake value from its arguments' current ones (after a pass changed an
    argument or what an input produces); False (node untouched) where it has none to recompute."""
    fake_mode = _fake_mode(node)
    if fake_mode is None:
        return False
    args = torch.fx.node.map_arg(node.args, val)
    kwargs = torch.fx.node.map_arg(node.kwargs, val)
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)
    return True


def refake_downstream(node: torch.fx.Node) -> None:
    """Recompute the fake values of node's users, and on along every user whose value's shape or
    strides changed, so that later passes planning by layout (the pointwise rest) see the layouts
    the graph will run with. A user whose value cannot be recomputed keeps its old one (the graph
    runs the same: only a layout plan may then be conservative)."""
    stack = [node]
    while stack:
        for user in stack.pop().users:
            before = _layouts(user.meta.get("val"))
            try:
                changed = refake(user) and _layouts(user.meta.get("val")) != before
            except Exception:  # noqa: BLE001 - a fake value is an aid to later passes, not the graph's meaning
                changed = False
            if changed:
                stack.append(user)


def _layouts(value) -> list:
    values = value if isinstance(value, (tuple, list)) else [value]
    return [(tuple(v.shape), v.stride()) if isinstance(v, torch.Tensor) else None for v in values]


def same_shape(s1, s2) -> bool:
    """True only when the shapes are provably equal; never adds a guard on symbolic sizes."""
    return len(s1) == len(s2) and all(statically_known_true(a == b) for a, b in zip(s1, s2))


def is_one(size) -> bool:
    return statically_known_true(size == 1)


def frames(node: torch.fx.Node) -> list[tuple[str, str, str]]:
    """(path, line, function) of each frame in the node's user stack trace, outermost first."""
    return re.findall(r'File "([^"]+)", line (\d+), in (\S+)', node.meta.get("stack_trace") or "")


def location(node: torch.fx.Node) -> str:
    """Where the user wrote the node: 'file.py:42 in forward' from its stack trace; else (a model
    that is itself a container of torch modules, such as an nn.Sequential, leaves no user frame)
    the module it ran in, 'Sequential.2.0 (Linear)'; else the node's name. Frames inside the
    lowering package (a library function substituted while Dynamo traced) are skipped: the
    caller is the news."""
    user = [f for f in frames(node) if not os.path.abspath(f[0]).startswith(_LOWERING_DIR)]
    if user:
        path, line, fn = user[-1]
        return f"{path.rsplit('/', 1)[-1]}:{line} in {fn}"
    return _module_path(node) or node.name


def _module_path(node: torch.fx.Node) -> str | None:
    """'Sequential.2.0 (Linear)' from the node's nn_module_stack (outermost module first)."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    if not stack:
        return None
    (root, root_cls), (inner, inner_cls) = stack[0], stack[-1]
    name = getattr(root_cls, "__name__", str(root_cls))
    sub = inner[len(root):].lstrip(".") if inner.startswith(root) else inner
    return f"{name}.{sub} ({getattr(inner_cls, '__name__', inner_cls)})" if sub else name


def _is_view(target) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


def alias_base(node):
    """The node whose memory `node` views (node itself when it is no view)."""
    while (isinstance(node, torch.fx.Node) and node.op == "call_function" and _is_view(node.target) and node.args
           and isinstance(node.args[0], torch.fx.Node)):
        node = node.args[0]
    return node


def mutated_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes whose value is written in place somewhere in the graph: directly, through a view
    (which writes its base), or through its base or another view of it (which shares its
    memory). A chain may not fuse across such a value: the fused op could read it before the
    write, or after it."""
    views: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        base = node.args[0] if node.op == "call_function" and node.args else None
        if isinstance(base, torch.fx.Node) and _is_view(node.target):
            views.setdefault(base, []).append(node)
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
    while todo:  # the whole alias family: up to the base, down to every view of it
        n = todo.pop()
        related = list(views.get(n, ()))
        if n.op == "call_function" and _is_view(n.target) and n.args and isinstance(n.args[0], torch.fx.Node):
            related.append(n.args[0])
        for r in related:
            if r not in written:
                written.add(r)
                todo.append(r)
    return written
