"""ONNX export with the fused ops as custom-domain nodes that carry their own bodies:
`torch_xaccel.onnx.export(model, args, "model.onnx")` (export.py). Each family's bodies live
beside its reference, in ops/<family>/onnx.py. Importing it registers the `xaccel` domain's
onnx schemas (schemas.py), for onnx's checker and shape inference."""
from . import schemas
from .export import ExportResult, export  # noqa: F401

schemas.register()
