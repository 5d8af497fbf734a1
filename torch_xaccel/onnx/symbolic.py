"""Each xaccel op as one node of the `xaccel` ONNX domain: a decomposition that torch.export's
run_decompositions applies, calling torch.onnx.ops.symbolic with the op's tensors as inputs and its
other arguments as attributes. Built from the op's schema, so every op translates the same way:
- Tensor and Tensor? arguments are inputs (a None input is an empty name; trailing ones are left
  out); a Tensor[] argument is flattened into inputs and counted by an int attribute `<name>_count`;
- bool, int, float, str (and lists of them) are attributes of the same name (bool as an int 0/1);
- the outputs' dtypes and shapes come from the op's registered fake implementation.
No ONNX schema is needed to export (the node's meaning lives in the FunctionProto attached after
export, or in a runtime that knows the domain); schemas.py states the same rules as onnx schemas."""
from __future__ import annotations

import torch
from onnx import AttributeProto

DOMAIN = "xaccel"
VERSION = 1


def _fake_kernel(op: torch._ops.OpOverload):
    """The fake (meta) implementation registered with torch.library for a custom op."""
    from torch._library.simple_registry import singleton

    entry = singleton.find(op._schema.name)
    kernel = entry.fake_impl.kernel if entry.fake_impl is not None else None
    if kernel is None:
        raise ValueError(f"{op._schema.name} has no fake implementation: it cannot be exported")
    return kernel.func


def op_type(op: torch._ops.OpOverload) -> str:
    """The node's op_type: the op's name in torch.ops.xaccel."""
    return op._schema.name.split("::")[1]


def is_tensor(arg) -> bool:
    return isinstance(arg.type, torch.TensorType) or (
        isinstance(arg.type, torch.OptionalType) and isinstance(arg.type.getElementType(), torch.TensorType))


def is_tensor_list(arg) -> bool:
    return isinstance(arg.type, torch.ListType) and isinstance(arg.type.getElementType(), torch.TensorType)


def count_name(arg) -> str:
    """The int attribute counting a Tensor[] argument's inputs."""
    return f"{arg.name}_count"


_SCALARS = {torch.BoolType: AttributeProto.INT, torch.IntType: AttributeProto.INT, torch.SymIntType: AttributeProto.INT,
            torch.FloatType: AttributeProto.FLOAT, torch.StringType: AttributeProto.STRING}
_LISTS = {AttributeProto.INT: AttributeProto.INTS, AttributeProto.FLOAT: AttributeProto.FLOATS,
          AttributeProto.STRING: AttributeProto.STRINGS}


def attribute_type(op: torch._ops.OpOverload, arg) -> int:
    """The ONNX attribute type (AttributeProto.INT, ...) of a non-tensor argument."""
    t = arg.type.getElementType() if isinstance(arg.type, torch.OptionalType) else arg.type
    listed = isinstance(t, torch.ListType)
    kind = _SCALARS.get(type(t.getElementType() if listed else t))
    if kind is None:
        raise ValueError(f"{op._schema.name}: argument {arg.name} of type {arg.type} has no ONNX form")
    return _LISTS[kind] if listed else kind


_CASTS = {AttributeProto.INT: int, AttributeProto.FLOAT: float, AttributeProto.STRING: str,
          AttributeProto.INTS: int, AttributeProto.FLOATS: float, AttributeProto.STRINGS: str}


def attribute_value(kind: int, value):
    """`value` as an attribute of type `kind` holds it (a bool as 0/1, an int given for a float as
    a float), so that a node's attribute types are always its schema's."""
    cast = _CASTS[kind]
    return [cast(v) for v in value] if kind in _LISTS.values() else cast(value)


def may_be_absent(arg) -> bool:
    """Whether split can leave the argument's attribute out: a None or an empty list."""
    return isinstance(arg.type, (torch.OptionalType, torch.ListType))


def split(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[list, dict]:
    """(ONNX inputs, ONNX attributes) of one call of `op`, by its schema."""
    inputs, attrs = [], {}
    for i, a in enumerate(op._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
        if is_tensor(a):
            inputs.append(value)
        elif is_tensor_list(a):
            inputs.extend(value)
            attrs[count_name(a)] = len(value)
        elif not (value is None or value == [] or value == ()):  # else an absent optional attribute
            attrs[a.name] = attribute_value(attribute_type(op, a), value)
    while inputs and inputs[-1] is None:
        inputs.pop()
    return inputs, attrs


def decomposition(op: torch._ops.OpOverload):
    """The run_decompositions entry for `op`: one `xaccel` node with the op's outputs."""
    fake = _fake_kernel(op)
    name = op._schema.name
    many = len(op._schema.returns) != 1 or isinstance(op._schema.returns[0].type, torch.ListType)

    def decompose(*args, **kwargs):
        outs = fake(*args, **kwargs)
        inputs, attrs = split(op, args, kwargs)
        listed = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        dtypes, shapes = [o.dtype for o in listed], [o.shape for o in listed]
        if not many:
            return torch.onnx.ops.symbolic(name, inputs, attrs, dtype=dtypes[0], shape=shapes[0], version=VERSION)
        got = torch.onnx.ops.symbolic_multi_out(name, inputs, attrs, dtypes=dtypes, shapes=shapes, version=VERSION)
        return list(got) if isinstance(outs, list) else tuple(got)

    decompose.__name__ = f"xaccel_{op_type(op)}_to_onnx"
    return decompose
