"""Kernels for the headwise op: Triton, memory-bound (blocks of up to MAX_BLOCK x MAX_BLOCK).

- triton_kernels.py + templates/headwise{,_weight_grad}.py.jinja: the forward (also the input
  gradient) and the weight gradient
"""
from .triton_kernels import DTYPES, MAX_BLOCK, forward, weight_grad  # noqa: F401
