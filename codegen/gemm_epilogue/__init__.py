"""Kernels for xaccel::gemm_epilogue.

- render.py + templates/gemm_epilogue*.py.jinja: the Triton kernels (pointer and TMA variants)
- cutlass_kernels.py + templates/gemm_epilogue_cutlass.cu.jinja: CUTLASS 3 sm90 kernels with the
  chain as an epilogue visitor tree, built by nvcc in the background
- triton_kernels.py: the provider: tile configs, tuning against ATen and CUTLASS, launch plans
"""
from .triton_kernels import provider  # noqa: F401
