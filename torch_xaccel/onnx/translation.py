"""torch_xaccel.onnx.translation_table(): plain `torch.onnx.export(model, args, dynamo=True,
custom_translation_table=translation_table())` of a model whose own code calls torch.ops.xaccel.*.

Each call becomes what torch_xaccel.onnx.export writes for it: one `xaccel` node (symbolic.split's
inputs and attributes), its overload the call form's key, calling that form's function
(functions.function_for: the family's body, the same one attach() adds), built at the opset the
exporter builds its graph at. The exporter adds the functions to the model, and its version
converter (which runs on every torch.onnx.export(dynamo=True): the opset asked for, or torch's
default) inlines every function: the file holds each call's body as standard ONNX, which a stock
onnxruntime runs. torch_xaccel.onnx.export is the one that keeps one xaccel node per call."""
from __future__ import annotations

import torch

from . import functions as bodies, symbolic


def translation_table() -> dict:
    """torch.ops.xaccel.<op>.default -> its translation, for every op with an ONNX body."""
    return {op: _translation(op) for op in bodies.translatable_ops()}


def _dims(value) -> tuple | None:
    """An IR value's dims as functions.dims gives a ModelProto's: ints, symbol names, None."""
    if value.shape is None:
        return None
    return tuple(d if isinstance(d, int) else (None if d.value is None else str(d.value)) for d in value.shape)


def _as_in_a_file(attrs: dict) -> dict:
    """The attributes as a body builder reads them from a ModelProto (functions._attrs): strings
    as bytes, floats at float32, so that both paths build the same body for one call form."""
    from onnx import helper

    return {k: helper.get_attribute_value(helper.make_attribute(k, v)) for k, v in attrs.items()}


def _output_count(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> int:
    """The op's outputs: its schema's returns, or for a Tensor[] return the length of what its
    fake implementation returns for meta stand-ins of the inputs (one size per dim name)."""
    from onnxscript import ir

    returns = op._schema.returns
    if not (len(returns) == 1 and isinstance(returns[0].type, torch.ListType)):
        return len(returns)
    sizes: dict[str, int] = {}

    def stand_in(value):
        if not isinstance(value, ir.Value):
            return value
        if value.shape is None:
            raise ValueError(f"{op._schema.name}: an input of unknown rank: its outputs cannot be counted")
        shape = [d if isinstance(d, int) else sizes.setdefault(str(d.value), 3 + len(sizes)) for d in value.shape]
        dtype = bodies.torch_dtype(None if value.dtype is None else int(value.dtype)) or torch.float32
        return torch.empty(shape, dtype=dtype, device="meta")
    outs = symbolic._fake_kernel(op)(*torch.utils._pytree.tree_map(stand_in, list(args)),
                                     **torch.utils._pytree.tree_map(stand_in, dict(kwargs)))
    return len(outs)


def _translation(op: torch._ops.OpOverload):
    name = symbolic.op_type(op)
    many = len(op._schema.returns) != 1 or isinstance(op._schema.returns[0].type, torch.ListType)

    def translate(*args, **kwargs):
        from onnxscript import evaluator, ir
        from onnxscript.ir import convenience

        tracer = evaluator.default()  # torch.onnx's recorder of the nodes and functions of this call
        if not (hasattr(tracer, "nodes") and hasattr(tracer, "functions") and hasattr(tracer, "opset")):
            raise RuntimeError(f"xaccel::{name}: translation_table() is for torch.onnx.export(dynamo=True)")
        inputs, attrs = symbolic.split(op, args, kwargs)
        opset = _building_opset(tracer)
        call = bodies.Call(name, _as_in_a_file(attrs), tuple(v is not None for v in inputs),
                           tuple(None if v is None or v.dtype is None else int(v.dtype) for v in inputs), opset,
                           tuple(None if v is None else _dims(v) for v in inputs))
        if (symbolic.DOMAIN, name, call.key) not in tracer.functions:
            fn = _built_aside(lambda: bodies.function_for(call, {"": opset}))
            tracer.functions[(symbolic.DOMAIN, name, call.key)] = ir.serde.deserialize_function(fn)
        node = ir.Node(symbolic.DOMAIN, name, inputs, convenience.convert_attributes(attrs), overload=call.key,
                       num_outputs=_output_count(op, args, kwargs), version=symbolic.VERSION)
        tracer.nodes.append(node)
        return list(node.outputs) if many else node.outputs[0]

    translate.__name__ = f"xaccel_{name}_translation"
    return translate


def _building_opset(tracer) -> int:
    """The default domain's version of the model under construction: torch.onnx builds at its
    torchlib opset and converts to the one asked for afterwards (inlining every function first,
    which needs the functions' imports to be the model's)."""
    try:
        from torch.onnx._internal.exporter import _constants

        return int(_constants.TORCHLIB_OPSET)
    except (ImportError, AttributeError):  # another torch: the recorder's opset
        return int(tracer.opset.version)


def _built_aside(build):
    """build() (a body, which runs torch.onnx.export on the op's reference) inside the export that
    is translating the model: that inner export clears torch.onnx's "exporting" flag on its way
    out, so it is set back to what it was."""
    try:
        from torch.onnx._internal.exporter import _flags
    except ImportError:  # another torch: nothing to keep
        return build()
    flag = _flags._is_onnx_exporting
    try:
        return build()
    finally:
        _flags._is_onnx_exporting = flag
