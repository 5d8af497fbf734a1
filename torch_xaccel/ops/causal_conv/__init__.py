"""The causal_conv op: xaccel::causal_conv1d, a causal depthwise convolution over positions (the
short convolution of xLSTM, Mamba-style and similar layers), and its backward.

- reference.py: the ops' semantics
- op.py: their registration (schemas, fakes, autograd)
- onnx.py: the ONNX body, from the reference
"""
from . import op  # noqa: F401  (registers torch.ops.xaccel.causal_conv1d, causal_conv1d_backward)
from .op import DIRECT_CALLS  # noqa: F401
