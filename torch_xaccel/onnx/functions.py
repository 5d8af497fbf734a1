"""The ONNX FunctionProto bodies of the xaccel nodes, attached after export.

The exporter inlines every function that exists while it runs (its version converter), so the
bodies are added to the finished model: one function per distinct call form (op, attributes,
which optional inputs are present, input dtype), told apart by the IR-10 `overload` field of the
node and the function. Each family builds its bodies (`ops/<family>/onnx.py`, listed in
families.py under `onnx`) from its op's one reference; this module gives them a Call, sets the
function's name, domain, opset imports (exactly the model's: a body importing another version
than the model fails the checker where an op's schema changed) and overload, and appends it."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import warnings
from dataclasses import dataclass

import onnx
from onnx import helper

from torch_xaccel import families

from .symbolic import DOMAIN


@dataclass(frozen=True)
class Call:
    """One xaccel node as its family's body builder sees it."""
    op: str  # the op's name in torch.ops.xaccel and the node's op_type
    attrs: dict  # attribute name -> Python value
    inputs: tuple[bool, ...]  # per input position: present or absent
    elem_types: tuple[int | None, ...]  # per input position: the ONNX element type, when known
    opset: int  # the model's version of the default ONNX domain
    # per input position: its dims (an int, or a symbol's name), None where unknown
    shapes: tuple[tuple | None, ...] = ()

    @property
    def key(self) -> str:
        """The overload name of this call form."""
        text = repr((self.op, sorted(self.attrs.items()), self.inputs, self.elem_types, self.shapes))
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def dims(t: onnx.TypeProto.Tensor) -> tuple | None:
    """A tensor type's dims: ints, symbol names, None for an unknown dim; None when the rank is unknown."""
    if not t.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)


def _value_types(model: onnx.ModelProto) -> dict[str, tuple[int, tuple | None]]:
    """value name -> (ONNX element type, dims: ints, symbol names, None for an unknown dim; None
    when the rank is unknown)."""
    types = {}
    for v in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        if v.type.HasField("tensor_type"):
            types[v.name] = (v.type.tensor_type.elem_type, dims(v.type.tensor_type))
    for t in model.graph.initializer:
        types[t.name] = (t.data_type, tuple(t.dims))
    return types


def builders() -> dict:
    """op name -> its family's body builder (families.py)."""
    return {op: families.resolve(path) for f in families.FAMILIES for op, path in f.onnx.items()}


def translatable() -> set[str]:
    return {op for f in families.FAMILIES for op in f.onnx}


def translatable_ops() -> list:
    """The torch.ops.xaccel overloads that have an ONNX body: what an export can emit."""
    import torch

    return [getattr(torch.ops.xaccel, op).default for op in sorted(translatable())]


def count(model: onnx.ModelProto) -> dict[str, int]:
    """The xaccel nodes of the model's main graph, per op."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain == DOMAIN:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def function_for(call: Call, opset_imports: dict[str, int], build: dict | None = None) -> onnx.FunctionProto:
    """The function of one call form: its family's body (`build`, default builders()), named as
    the node (op_type, the `xaccel` domain, overload `call.key`) and importing `opset_imports`
    (domain -> version; the model's, less the `xaccel` domain, so that every op in the body has
    the model's schema). One definition for torch_xaccel.onnx.export (attach) and plain
    torch.onnx.export (translation.py)."""
    build = builders() if build is None else build
    if call.op not in build:
        raise ValueError(f"xaccel::{call.op} has no ONNX body yet (ops/<family>/onnx.py): export it with "
                         f"functions=False for a runtime that implements the xaccel domain")
    fn = _body(build[call.op], call)
    fn.name, fn.domain, fn.overload = call.op, DOMAIN, call.key
    del fn.opset_import[:]
    fn.opset_import.extend(helper.make_opsetid(d, v) for d, v in opset_imports.items() if d != DOMAIN)
    return fn


def attach(model: onnx.ModelProto) -> dict[str, int]:
    """Append a FunctionProto for every form of xaccel node in the model's main graph; returns the
    node count per op. A node whose op has no body builder raises ValueError naming it. Reads only
    the initializers' names, types and dims: a model whose weights were left out works the same."""
    build = builders()
    imports = {o.domain: o.version for o in model.opset_import}
    opset = imports.get("", imports.get("ai.onnx"))
    types = _value_types(model)
    made: set[str] = set()
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        known = [types.get(name, (None, None)) if name else (None, None) for name in node.input]
        call = Call(node.op_type, _attrs(node), tuple(bool(name) for name in node.input),
                    tuple(k[0] for k in known), opset, tuple(k[1] for k in known))
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
        node.overload = call.key
        if call.key not in made:
            model.functions.append(function_for(call, imports, build))
            made.add(call.key)
    return counts


def _body(builder, call: Call) -> onnx.FunctionProto:
    """builder(call), its ValueErrors led by the op's name."""
    try:
        return builder(call)
    except ValueError as e:
        if str(e).startswith(f"xaccel::{call.op}"):
            raise
        raise ValueError(f"xaccel::{call.op}: {e}") from e


def renamed_graph(graph: onnx.GraphProto, prefix: str, outer: dict[str, str]) -> onnx.GraphProto:
    """A copy of `graph` for use inside a function: every value name prefixed, except the inputs
    in `outer`, which become references to those names of the enclosing scope (and leave the
    graph's input list); initializers become Constant nodes (a function has none)."""
    def name(n: str) -> str:
        return "" if not n else outer.get(n, prefix + n)
    g = onnx.GraphProto()
    g.name = prefix + graph.name
    for t in graph.initializer:
        value = onnx.TensorProto()
        value.CopyFrom(t)
        g.node.append(helper.make_node("Constant", [], [name(t.name)], value=value))
    for n in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        copy.input[:] = [name(i) for i in n.input]
        copy.output[:] = [name(o) for o in n.output]
        copy.name = prefix + n.name if n.name else ""
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            raise ValueError(f"a reference body holds a subgraph ({n.op_type}): not supported")
        g.node.append(copy)
    for v in graph.input:
        if v.name not in outer:
            g.input.append(helper.make_value_info(name(v.name), v.type))
    for v in graph.output:
        g.output.append(helper.make_value_info(name(v.name), v.type))
    return g


# torch's own deprecation warning, raised inside torch.export and torch.onnx's exporter on every
# export (their pytree code checks `isinstance(spec, LeafSpec)`): nothing a caller can act on.
_TORCH_NOISE = [(FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated")]


@contextlib.contextmanager
def quiet_exporter():
    """Around a call of torch.export or torch.onnx's exporter, what is noise on every export: the
    LeafSpec FutureWarning, the notes on axis names shared between inputs (other warnings pass),
    and the registration's log below ERROR (a warning per torchvision op it cannot register when
    torchvision is absent)."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*axis name.*will not be used.*")
            for category, message in _TORCH_NOISE:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        logger.setLevel(level)


def reference_graph(module, example: tuple, dynamic_shapes, opset: int) -> onnx.GraphProto:
    """A family's reference function (wrapped in `module`) as an ONNX graph, exported by torch.onnx
    at the model's opset: the source of a body that computes exactly the reference's math."""
    import torch

    with quiet_exporter():
        program = torch.onnx.export(module, example, dynamo=True, dynamic_shapes=dynamic_shapes, opset_version=opset,
                                    verbose=False)
    graph = program.model_proto.graph
    _check_dims_kept(graph, example, dynamic_shapes, module)
    return graph


def _check_dims_kept(graph: onnx.GraphProto, example: tuple, dynamic_shapes, module) -> None:
    """A reference whose code fixes a dim given as dynamic (torch.onnx then writes the input with
    that number, and every size after it): a ValueError saying which, never a body that runs
    only at the example's size."""
    import torch

    specs = torch.utils._pytree.tree_leaves(dynamic_shapes, is_leaf=lambda x: x is None or isinstance(x, dict))
    tensors = torch.utils._pytree.tree_leaves(example)
    if not len(graph.input) == len(specs) == len(tensors):  # an input left out: no safe pairing
        return
    for k, (value, spec, tensor) in enumerate(zip(graph.input, specs, tensors)):
        got = dims(value.type.tensor_type) or ()
        for axis in spec or {}:
            if axis < len(got) and isinstance(got[axis], int):
                raise ValueError(f"the reference ({type(module).__name__}) fixes dim {axis} of its input {k} to "
                                 f"{tensor.shape[axis]}: its ONNX body would run only at that size")


TORCH_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64",
                onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16"}


def torch_dtype(elem_type: int | None):
    """The torch dtype of an ONNX float element type (None for others)."""
    import torch

    name = TORCH_DTYPES.get(elem_type)
    return getattr(torch, name) if name else None


def elem_type(dtype) -> int | None:
    """The ONNX element type of a torch float dtype (None for others)."""
    return next((e for e, name in TORCH_DTYPES.items() if str(dtype) == f"torch.{name}"), None)


def examples(call, positions) -> tuple[tuple, tuple]:
    """(example tensors, torch.export dynamic shapes) for the inputs at `positions`, from the
    node's types: every symbolic dim an export Dim (one per symbol name, so that equal sizes stay
    equal; an unknown dim its own), with distinct example sizes from 3 up (0 and 1 would be
    specialized). A 0-d input is a 0-d example."""
    import torch

    dims: dict[str, object] = {}
    sizes: dict[str, int] = {}
    tensors, shapes = [], []
    for p in positions:
        shape, elem = call.shapes[p] if p < len(call.shapes) else None, call.elem_types[p]
        if shape is None or elem not in TORCH_DTYPES:
            raise ValueError(f"xaccel::{call.op}: input {p} has no known rank or float dtype in the exported graph")
        concrete, dynamic = [], {}
        for axis, d in enumerate(shape):
            if d is None:  # no name: a symbol of its own
                d = f"?{p}.{axis}"
            if isinstance(d, str):
                if d not in dims:
                    dims[d] = torch.export.Dim(f"d{len(dims)}")
                    sizes[d] = 2 + len(sizes) + 1
                concrete.append(sizes[d])
                dynamic[axis] = dims[d]
            else:
                concrete.append(d)
        tensors.append(torch.randn(concrete, dtype=torch_dtype(elem)))  # a list: a 0-d input has no sizes
        shapes.append(dynamic or None)
    return tuple(tensors), tuple(shapes)


def function_of(graph: onnx.GraphProto, inputs: list[str], outputs: list[str], prefix: str,
                order: list[str] | None = None) -> onnx.FunctionProto:
    """A function of `graph`: its inputs renamed `inputs` (in the graph's order), declared in
    `order` (default: that order, the node's); its first len(outputs) outputs renamed `outputs`."""
    body = renamed_graph(graph, prefix, dict(zip([v.name for v in graph.input], inputs)))
    nodes = list(body.node) + [helper.make_node("Identity", [v.name], [o]) for v, o in zip(body.output, outputs)]
    return helper.make_function("xaccel", "body", order or inputs, outputs, nodes, [])
