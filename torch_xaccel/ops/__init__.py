"""The torch.ops.xaccel.* custom ops: the contract between lowering, runtime and ONNX export.

Each module defines one op: its reference (the op's only semantics, and the CPU path), its fake
(shape) function and its autograd formula.
"""
from . import gemm_epilogue  # noqa: F401  (registers torch.ops.xaccel.gemm_epilogue)
