"""Kernels for the causal_conv op: Triton, memory-bound (kernel sizes up to MAX_K).

- triton_kernels.py + templates/causal_conv1d{,_weight_grad}.py.jinja: the forward (also the
  input gradient) and the weight and bias gradients
"""
from .triton_kernels import DTYPES, MAX_K, backward, forward, why_not  # noqa: F401
