"""ONNX export with the fused ops as custom-domain nodes that carry their own bodies:
`torch_xaccel.onnx.export(model, args, "model.onnx")` (export.py); for a model whose code calls
torch.ops.xaccel.* itself, `torch.onnx.export(..., dynamo=True,
custom_translation_table=torch_xaccel.onnx.translation_table())` (translation.py). Each family's
bodies live beside its reference, in ops/<family>/onnx.py. Importing it registers the `xaccel`
domain's onnx schemas (schemas.py), for onnx's checker and shape inference. It logs on the
`torch_xaccel.onnx` logger and prints nothing."""
from . import schemas
from .export import ExportResult, export  # noqa: F401
from .translation import translation_table  # noqa: F401

schemas.register()
