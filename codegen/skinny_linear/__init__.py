"""Kernels for the skinny_linear op: Triton, memory-bound (up to MAX_N outputs over up to
MAX_INPUTS inputs read in place).

- triton_kernels.py + templates/skinny_linear{,_backward}.py.jinja: the forward, and the backward
  (the inputs' gradients with the weight gradient's partial sums)
"""
from .triton_kernels import DTYPES, MAX_INPUTS, MAX_N, MIN_ROWS, backward, forward, why_not  # noqa: F401
