"""The sLSTM ops: xaccel::slstm (a sequence, with its backward as an op of its own) and
xaccel::slstm_step (one step, for decoding).

- reference.py: the ops' semantics (the step and the loop over time), with the variant flags
- op.py: their registration (schemas, fakes, autograd)
"""
from . import op  # noqa: F401  (registers torch.ops.xaccel.slstm*, slstm_step)
from .op import DIRECT_CALLS  # noqa: F401
