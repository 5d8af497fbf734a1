"""What generated kernels may address and ask for: element offsets are int32, and a tile config
may not ask more shared memory than an sm_90 block has."""
from __future__ import annotations

import torch

INT32_LIMIT = 2 ** 31  # elements from a tensor's start that an int32 offset can reach
SHARED_LIMIT = 232448  # bytes of shared memory per block on sm_90 (227 KiB)


def reach(t: torch.Tensor) -> int:
    """How many elements from its start a tensor's elements span (its farthest offset + 1), given
    its strides: a view sliced from a wider tensor reaches farther than its numel."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
