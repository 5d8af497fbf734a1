"""The generated kernels compute element offsets in int32: what they may address."""
from __future__ import annotations

import torch

INT32_LIMIT = 2 ** 31  # elements from a tensor's start that an int32 offset can reach


def reach(t: torch.Tensor) -> int:
    """How many elements from its start a tensor's elements span (its farthest offset + 1), given
    its strides: a view sliced from a wider tensor reaches farther than its numel."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
