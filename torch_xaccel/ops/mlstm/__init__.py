"""The mLSTM ops: xaccel::mlstm (a sequence; with its saving variant, xaccel::mlstm_saving, and its
backward as ops of their own) and xaccel::mlstm_step (one recurrent step, for decoding).

- reference.py: the ops' semantics (the chunkwise forward, the step, the O(S^2) parallel oracle)
- reference_backward.py: the analytic chunkwise backward in plain torch
- op.py: their registration (schemas, fakes, autograd)
"""
from . import op  # noqa: F401  (registers torch.ops.xaccel.mlstm*, mlstm_step)
from .op import DIRECT_CALLS, gradient_like, gradient_strides, h_like, kept_shapes  # noqa: F401
