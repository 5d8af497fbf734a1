"""The precision of the generated kernels' fp32 dots (`tl.dot(..., input_precision=...)`): what
torch's float32 matmul setting allows, as cuBLAS and Inductor read it, at call time.

    torch.set_float32_matmul_precision("highest")  -> "tf32x3" (3xTF32: each fp32 operand split
        into a TF32 high part and a TF32 residual, three tensor-core products; close to IEEE fp32,
        several times faster than "ieee", which runs on the FMA units)
    torch.set_float32_matmul_precision("high" or "medium")  -> "tf32"

16-bit operands take "ieee" (Triton ignores the precision for them; the kernels' names stay
what they were). Under Triton's interpreter "ieee": it computes every dot with NumPy whatever the
precision. `forced(...)` overrides the choice for a block (benchmarks time "ieee" beside the
others). The choice is part of every kernel's name and cache key and of the tuning keys, so a
kernel or a decision made at one precision is never reused at another.

The setting is read through `torch.backends.cuda.matmul.fp32_precision` where torch has it
(2.9 on: "tf32", "ieee", or "none" for the default, which is IEEE; what Inductor reads): the
legacy readers, `torch.get_float32_matmul_precision()` and `...matmul.allow_tf32`, raise a
RuntimeError on torch 2.13 once a program mixed the legacy and the new setters. Without it,
`torch.get_float32_matmul_precision()` ("high" and "medium" allow TF32), then `allow_tf32`."""
from __future__ import annotations

import contextlib
import contextvars

import torch

from torch_xaccel.runtime import interpreting

IEEE, TF32, TF32X3 = "ieee", "tf32", "tf32x3"
PRECISIONS = (IEEE, TF32, TF32X3)

_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("xaccel_fp32_dot_precision", default=None)


def torch_allows_tf32() -> bool:
    """Whether torch's float32 matmul setting lets fp32 matmuls run in TF32 on CUDA ("high" or
    "medium"; "highest", the default, does not)."""
    matmul = torch.backends.cuda.matmul
    try:
        new = matmul.fp32_precision
    except (AttributeError, RuntimeError):
        new = None
    if isinstance(new, str):
        return new.lower() == TF32
    try:
        return torch.get_float32_matmul_precision() in ("high", "medium")
    except RuntimeError:
        pass
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return False  # (unreadable: the default, "highest")


def dot_precision(dtype: torch.dtype) -> str:
    """The input_precision of the generated kernels' dots on operands of `dtype`."""
    if dtype != torch.float32:
        return IEEE
    forced_now = _FORCED.get()
    if forced_now is not None:
        return forced_now
    if interpreting():
        return IEEE
    return TF32 if torch_allows_tf32() else TF32X3


@contextlib.contextmanager
def forced(precision: str | None):
    """Run a block with every fp32 dot at `precision` ("ieee", "tf32" or "tf32x3"; None: torch's
    setting) whatever torch's setting says: for benchmarks and tests, not for models."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"fp32 dot precision must be one of {PRECISIONS}, got {precision!r}")
    token = _FORCED.set(precision)
    try:
        yield
    finally:
        _FORCED.reset(token)
