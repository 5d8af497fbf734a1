"""Each xaccel op as one node of the `xaccel` ONNX domain: a decomposition that torch.export's
run_decompositions applies, calling torch.onnx.ops.symbolic with the op's tensors as inputs and its
other arguments as attributes. Built from the op's schema, so every op translates the same way:
- Tensor and Tensor? arguments are inputs (a None input is an empty name; trailing ones are left
  out); a Tensor[] argument is flattened into inputs and counted by an int attribute `<name>_count`;
- bool, int, float, str (and lists of them) are attributes of the same name (bool as an int 0/1);
- the outputs' dtypes and shapes come from the op's registered fake implementation.
No ONNX schema is needed to export (the node's meaning lives in the FunctionProto attached after
export, or in a runtime that knows the domain)."""
from __future__ import annotations

import torch

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


def _is_tensor(arg) -> bool:
    return isinstance(arg.type, torch.TensorType) or (
        isinstance(arg.type, torch.OptionalType) and isinstance(arg.type.getElementType(), torch.TensorType))


def _is_tensor_list(arg) -> bool:
    return isinstance(arg.type, torch.ListType) and isinstance(arg.type.getElementType(), torch.TensorType)


def split(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[list, dict]:
    """(ONNX inputs, ONNX attributes) of one call of `op`, by its schema."""
    inputs, attrs = [], {}
    for i, a in enumerate(op._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
        if _is_tensor(a):
            inputs.append(value)
        elif _is_tensor_list(a):
            inputs.extend(value)
            attrs[f"{a.name}_count"] = len(value)
        elif isinstance(value, bool):
            attrs[a.name] = int(value)
        elif isinstance(value, (int, float, str)) or (isinstance(value, (list, tuple)) and value):
            attrs[a.name] = list(value) if isinstance(value, tuple) else value
        elif value is None or value == [] or value == ():
            continue  # an absent optional attribute
        else:
            raise ValueError(f"{op._schema.name}: argument {a.name} of type {a.type} has no ONNX form")
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

    decompose.__name__ = f"xaccel_{op._schema.name.split('::')[1]}_to_onnx"
    return decompose
