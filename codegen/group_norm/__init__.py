"""Kernels for the group_norm op: Triton, memory-bound (groups of up to MAX_GROUP channels).

- triton_kernels.py + templates/group_norm{,_backward}.py.jinja: the forward, and the backward
  (dx with the weight and bias gradients' partial sums)
"""
from .triton_kernels import DTYPES, MAX_GROUP, backward, forward, why_not  # noqa: F401
