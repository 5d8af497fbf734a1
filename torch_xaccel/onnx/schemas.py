"""The `xaccel` domain's operator schemas (onnx.defs.OpSchema, version 1): with them onnx's checker
validates each node's inputs and attributes, and its shape inference gives the nodes' output
types and shapes with or without bodies. Registered when torch_xaccel.onnx is imported; a file
never needs them (where none is registered, its FunctionProtos carry the nodes' meaning).

A schema follows from the op's torch schema by symbolic.py's rules, the ones that write the
nodes. Its inference function runs the op's registered fake implementation on fake tensors whose
symbolic sizes stand for the inputs' ONNX dim names, so the output shapes have one definition
(torch's): static dims come back as numbers, symbolic ones under their input's dim name."""
from __future__ import annotations

import onnx
import torch
from onnx import defs, helper

from . import functions, symbolic
from .symbolic import DOMAIN, VERSION, count_name, is_tensor, is_tensor_list, op_type

_Param = defs.OpSchema.FormalParameter
_Option = defs.OpSchema.FormalParameterOption
_Attribute = defs.OpSchema.Attribute


def _tensor_types() -> list[str]:
    """Every float type of the one ONNX dtype table (what the bodies take)."""
    return [f"tensor({onnx.TensorProto.DataType.Name(e).lower()})" for e in functions.TORCH_DTYPES]


def _inputs(op: torch._ops.OpOverload) -> list:
    """Tensor -> an input, Tensor? -> an optional one. ONNX lets only the last input be variadic,
    so the inputs from the first Tensor[] on are one variadic input, in split's order (its
    `<name>_count` attributes say where each list ends)."""
    params, tail = [], []
    for a in op._schema.arguments:
        if is_tensor_list(a) or (tail and is_tensor(a)):
            tail.append(a.name)
        elif is_tensor(a):
            option = _Option.Optional if isinstance(a.type, torch.OptionalType) else _Option.Single
            params.append(_Param(a.name, f"T_{a.name}", param_option=option))
    if tail:
        name = "_".join(tail)
        params.append(_Param(name, f"T_{name}", param_option=_Option.Variadic, is_homogeneous=False, min_arity=0))
    return params


def _outputs(op: torch._ops.OpOverload) -> list:
    returns = op._schema.returns
    if len(returns) == 1 and isinstance(returns[0].type, torch.ListType):
        return [_Param("outputs", "T_outputs", param_option=_Option.Variadic, is_homogeneous=False)]
    return [_Param(f"output{k}", f"T_output{k}") for k in range(len(returns))]


def _attribute(op: torch._ops.OpOverload, arg):
    kind = symbolic.attribute_type(op, arg)
    if arg.has_default_value() and arg.default_value not in (None, [], ()):
        default = helper.make_attribute(arg.name, symbolic.attribute_value(kind, arg.default_value))
        return _Attribute(arg.name, default, "")
    return _Attribute(arg.name, defs.OpSchema.AttrType(kind), "", required=not symbolic.may_be_absent(arg))


def _attributes(op: torch._ops.OpOverload) -> list:
    """What split writes: a `<name>_count` per Tensor[], every other non-tensor argument by name."""
    return [_Attribute(count_name(a), defs.OpSchema.AttrType.INT, "", required=True) if is_tensor_list(a)
            else _attribute(op, a) for a in op._schema.arguments if not is_tensor(a)]


def _python(arg, value):
    """An attribute's value as the op's argument (the inverse of symbolic.attribute_value)."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [v.decode() if isinstance(v, bytes) else v for v in value]
    t = arg.type.getElementType() if isinstance(arg.type, torch.OptionalType) else arg.type
    return bool(value) if isinstance(t, torch.BoolType) else value


def _arguments(op: torch._ops.OpOverload, tensors: list, attrs: dict) -> list:
    """The op's arguments of one node (the inverse of symbolic.split): `tensors` per input, None
    where absent; attributes by name."""
    args, rest = [], iter(tensors)
    for a in op._schema.arguments:
        if is_tensor(a):
            args.append(next(rest, None))
        elif is_tensor_list(a):
            args.append([next(rest) for _ in range(int(attrs[count_name(a)]))])
        else:
            value = attrs.get(a.name)
            args.append(a.default_value if value is None else _python(a, value))
    return args


class _Sizes:
    """Symbolic sizes for ONNX dims, one symbol per dim name, on one ShapeEnv. The hints are
    distinct and far from any real size, so no fake implementation specializes one to a constant."""

    def __init__(self):
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.env = ShapeEnv()
        self.named: dict[str, torch.SymInt] = {}
        self.names: dict[object, str] = {}  # the symbol of each name -> the name
        self.made = 0

    def size(self, dim: int | str | None):
        """A tensor size for an ONNX dim: the number, the name's symbol, or a fresh unnamed symbol."""
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic

        if isinstance(dim, int):
            return dim
        if dim in self.named:
            return self.named[dim]
        hint = 10007 + 13 * self.made
        symbol = self.env.create_symbol(hint, ConstantSource(f"onnx_dim{self.made}"), dynamic_dim=DimDynamic.DYNAMIC)
        size = self.env.create_symintnode(symbol, hint=hint)
        self.made += 1
        if dim is not None:
            self.named[dim], self.names[symbol] = size, dim
        return size

    def dim(self, size) -> int | str | None:
        """The ONNX dim of an output size: a number, an input's dim name, or None (unknown)."""
        if isinstance(size, int):
            return size
        expr = self.env.replace(size.node.expr)
        return int(expr) if expr.is_number else self.names.get(expr)


def _tensor(value: onnx.TypeProto, sizes: _Sizes) -> torch.Tensor | None:
    """A fake tensor of an input's type; None where its element type or rank is unknown."""
    t = value.tensor_type
    dtype = functions.torch_dtype(t.elem_type) if value.HasField("tensor_type") else None
    dims = functions.dims(t)
    if dtype is None or dims is None:
        return None
    return torch.empty([sizes.size(d) for d in dims], dtype=dtype)


def _output_type(out: torch.Tensor, sizes: _Sizes, op: torch._ops.OpOverload) -> onnx.TypeProto:
    elem = functions.elem_type(out.dtype)
    if elem is None:
        raise ValueError(f"xaccel::{op_type(op)}: an output of dtype {out.dtype} has no ONNX element type here")
    return helper.make_tensor_type_proto(elem, [sizes.dim(s) for s in out.shape])


def _named(op: torch._ops.OpOverload, error: Exception) -> str:
    """The error's message, led by the op's name (the ops' own errors already are)."""
    prefix = f"xaccel::{op_type(op)}"
    return str(error) if str(error).startswith(prefix) else f"{prefix}: {error}"


def _inference(op: torch._ops.OpOverload):
    """The schema's type and shape inference: the op's fake implementation on the node's inputs.
    An input of unknown type or rank leaves the outputs unknown; a node the op refuses (its fake
    raises: wrong ranks, a bad variant) is an inference error naming the op and the reason."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    names = [a.name for a in _attributes(op)]

    def infer(ctx) -> None:
        sizes = _Sizes()
        with FakeTensorMode(shape_env=sizes.env):
            tensors = [_tensor(ctx.get_input_type(i), sizes) if ctx.has_input(i) else None
                       for i in range(ctx.get_num_inputs())]
            if any(t is None and ctx.has_input(i) for i, t in enumerate(tensors)):
                return
            protos = {name: ctx.get_attribute(name) for name in names}
            attrs = {name: helper.get_attribute_value(p) for name, p in protos.items() if p is not None}
            try:
                outs = op(*_arguments(op, tensors, attrs))
            except Exception as e:  # noqa: BLE001 - reported as the node's inference error
                raise onnx.shape_inference.InferenceError(_named(op, e)) from e
        for k, out in enumerate(outs if isinstance(outs, (list, tuple)) else [outs]):
            ctx.set_output_type(k, _output_type(out, sizes, op))
    return infer


def schema(op: torch._ops.OpOverload) -> defs.OpSchema:
    """The ONNX schema of `op`'s node, with its inference function."""
    inputs, outputs = _inputs(op), _outputs(op)
    types = _tensor_types()
    doc = (f"torch_xaccel's {op._schema}: tensors are inputs (a Tensor[] flattened, its length the attribute "
           "<name>_count), other arguments attributes (a bool as an int 0/1); the output types are the op's")
    result = defs.OpSchema(op_type(op), DOMAIN, VERSION, doc, inputs=inputs, outputs=outputs,
                           type_constraints=[(p.type_str, types, "") for p in inputs + outputs],
                           attributes=_attributes(op))
    result.set_type_and_shape_inference_function(_inference(op))
    return result


def register() -> None:
    """Register the schema of every op an export can emit; one already registered stays (so a
    second call, or a second import, does nothing)."""
    for op in functions.translatable_ops():
        if not defs.has(op_type(op), VERSION, DOMAIN):
            defs.register_schema(schema(op))
