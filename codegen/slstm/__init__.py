"""Kernels for the sLSTM ops.

- configs.py: how a head splits over a thread-block cluster, and what fits the registers
- cuda_kernels.py + templates/slstm_forward.cu.jinja (+ csrc/slstm/): the persistent forward,
  built with NVRTC, launched on Hopper clusters
"""
from .cuda_kernels import forward  # noqa: F401
