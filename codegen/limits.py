"""What generated kernels may address and ask for: element offsets are int32, and a tile config
may not ask more shared memory than an sm_90 block has; Triton's host-side integer helpers, here so
that a CPU install without Triton imports the kernel modules."""
from __future__ import annotations

import torch

INT32_LIMIT = 2 ** 31  # elements from a tensor's start that an int32 offset can reach
SHARED_LIMIT = 232448  # bytes of shared memory per block on sm_90 (227 KiB)


def reach(t: torch.Tensor) -> int:
    """How many elements from its start a tensor's elements span (its farthest offset + 1), given
    its strides: a view sliced from a wider tensor reaches farther than its numel."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b), as triton.cdiv."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 not below n (0 for n <= 0), as triton.next_power_of_2."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
