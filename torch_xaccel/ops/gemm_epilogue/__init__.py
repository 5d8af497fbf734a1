"""xaccel::gemm_epilogue: one or two GEMMs sharing `a`, followed by an elementwise chain.

- elementwise.py: the ops a chain may hold (one table, read by every layer)
- epilogue_ir.py: the chain as a small SSA program, the op's `epilogue` argument
- reference.py: the op's semantics (forward, the ATen composition, backward)
- op.py: its registration (schema, fake, autograd)
"""
from . import op  # noqa: F401  (registers torch.ops.xaccel.gemm_epilogue)
from .op import DIRECT_CALLS, OP_NAME, case_key, run  # noqa: F401
