"""Kernels for the pointwise op: Triton, memory-bound (triton_kernels.py +
templates/pointwise.py.jinja)."""
from .triton_kernels import DTYPES, forward, layout_refusal, why_not  # noqa: F401
