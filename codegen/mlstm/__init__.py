"""Kernels for the mLSTM ops: Triton chunkwise forward and backward, and the decode step.

- configs.py: tile configurations, defaults and what fits shared memory
- triton_kernels.py + templates/mlstm_*.py.jinja: rendering, launches, tuning, the providers
"""
from .triton_kernels import (  # noqa: F401
    backward,
    backward_reads_kept_states,
    forward,
    forward_saving,
    step,
    why_not,
    why_not_on_cuda,
)
