"""The group_norm op: xaccel::group_norm, a group normalization of rows [N, C] (the per-head layer
norm of xLSTM layers: the xlstm package's MultiHeadLayerNorm), and its backward.

- reference.py: the ops' semantics
- op.py: their registration (schemas, fakes, autograd)
- onnx.py: the ONNX body, from the reference
"""
from . import op  # noqa: F401  (registers torch.ops.xaccel.group_norm, group_norm_backward)
from .op import DIRECT_CALLS  # noqa: F401
