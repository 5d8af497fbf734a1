"""Kernels for the sLSTM ops.

- configs.py: how a head splits over a thread-block cluster, and what fits the registers
- cuda_kernels.py + templates/slstm_{forward,backward}.cu.jinja (+ csrc/slstm/): the persistent
  forward and reverse-time backward, built with NVRTC, launched on Hopper clusters
- triton_step.py + templates/slstm_step.py.jinja: the decode step
"""
from .cuda_kernels import backward, backward_reads_kept_states, forward, forward_saving  # noqa: F401
from .triton_step import step  # noqa: F401
