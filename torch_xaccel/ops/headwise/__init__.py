"""The headwise op: xaccel::headwise, a linear map per head (a block-diagonal weight), and the
weight gradient its backward runs as an op of its own.

- reference.py: the ops' semantics
- op.py: their registration (schemas, fakes, autograd)
- onnx.py: the ONNX body, from the reference
"""
from . import op  # noqa: F401  (registers torch.ops.xaccel.headwise, headwise_weight_grad)
from .op import DIRECT_CALLS  # noqa: F401
