"""The skinny_linear op: xaccel::skinny_linear, a linear map with few outputs (the gate
projections of xLSTM layers: a head count of outputs) over the concatenation of its inputs along
their last dim, without materializing the concatenation; and its backward.

- reference.py: the ops' semantics
- op.py: their registration (schemas, fakes, autograd)
- onnx.py: the ONNX body, from the reference
"""
from . import op  # noqa: F401  (registers torch.ops.xaccel.skinny_linear, skinny_linear_backward)
from .op import DIRECT_CALLS  # noqa: F401
