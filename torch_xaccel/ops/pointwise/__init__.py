"""The pointwise op: xaccel::pointwise, a group of elementwise ops (the elementwise table's) over
tensors of one shape in one kernel, which the rest of a compiled graph runs instead of one ATen
kernel per op.

- program.py: what a call computes (the gemm_epilogue family's IR without GEMMs, plus the outputs'
  shape, dtype and strides)
- reference.py: the op's semantics
- op.py: its registration (schema, fake)
"""
from . import op  # noqa: F401  (registers torch.ops.xaccel.pointwise)
from .op import DIRECT_CALLS  # noqa: F401
