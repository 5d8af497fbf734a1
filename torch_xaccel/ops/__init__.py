"""The torch.ops.xaccel.* custom ops: the contract between lowering, runtime and ONNX export.

Each module defines one op: its reference (the op's only semantics, and the CPU path), its fake
(shape) function and its autograd formula.
"""
import torch

from . import gemm_epilogue  # noqa: F401  (registers torch.ops.xaccel.gemm_epilogue)
from . import mlstm, mlstm_step  # noqa: F401  (torch.ops.xaccel.mlstm, torch.ops.xaccel.mlstm_step)

# op overload -> the plain function behind it. A compiled forward graph runs with autograd
# already handled by aot_autograd, so it may call these directly and skip the custom-op
# dispatch (tens of microseconds a call: it decides whether decode-size GEMMs pay off).
DIRECT_CALLS = {torch.ops.xaccel.gemm_epilogue.default: gemm_epilogue.run,
                torch.ops.xaccel.mlstm_step.default: mlstm_step.run}
