"""Argument checks the xaccel ops share. Each raises a ValueError naming the op, the argument and
what was expected.

They read Python attributes only (dim, shape, dtype, stride), never tensor data: decode steps are
host-bound and a check must not synchronise with the device. Sizes may be symbolic (fake tensors
under dynamic shapes): a size is wrong only where it is provably wrong, so no check adds a guard
or specialises a size.
"""
from __future__ import annotations

from typing import NoReturn, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

ANY = None  # in an expected shape: a dim of any size
_COUNTS = {2: "both", 3: "all three", 4: "all four"}


def fail(op: str, message: str) -> NoReturn:
    raise ValueError(f"xaccel::{op}: {message}")


def differs(a, b) -> bool:
    """Whether sizes a and b are provably different (symbolic sizes: without a guard)."""
    if type(a) is int and type(b) is int:
        return a != b
    return statically_known_true(a != b)


def below(a, low: int) -> bool:
    """Whether size a is provably below low."""
    return a < low if type(a) is int else statically_known_true(a < low)


def _show(shape: Sequence) -> str:
    return "[" + ", ".join("*" if s is ANY else str(s) for s in shape) + "]"


def expect_shape(op: str, name: str, t: torch.Tensor, layout: str, shape: Sequence) -> None:
    """t has len(shape) dims and shape's sizes (ANY: any size); layout names the dims, as
    '[B, H, S, DK]', for the message. (A plain loop: the ops run it several times a call.)"""
    sizes = t.shape
    if len(sizes) == len(shape):
        for s, w in zip(sizes, shape):
            if w is not ANY and s is not w and differs(s, w):
                break
        else:
            return
    fail(op, f"{name} must be {layout} = {_show(shape)}, got {list(sizes)}")


def expect_rank(op: str, name: str, t: torch.Tensor, layout: str, at_least: int) -> None:
    """t has at least at_least dims (ops that take any leading dims, layout '[..., H, D]')."""
    if t.dim() < at_least:
        fail(op, f"{name} must be {layout} (at least {at_least}-D), got {list(t.shape)}")


def expect_float(op: str, name: str, t: torch.Tensor) -> None:
    if not t.dtype.is_floating_point:
        fail(op, f"{name} must have a floating-point dtype, got {t.dtype}")


def expect_floats(op: str, named: dict) -> None:
    """Every tensor of {name: tensor or None} has a floating-point dtype."""
    for name, t in named.items():
        if t is not None:
            expect_float(op, name, t)


def expect_dtype(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, source: str) -> None:
    """t has dtype, the dtype of the argument named source (which t must agree with)."""
    if t.dtype != dtype:
        fail(op, f"{name} must have {source}'s dtype {dtype}, got {t.dtype}")


def all_or_none(op: str, named: dict, what: str) -> bool:
    """Either every value of {name: tensor or None} is given or none; returns whether they are."""
    missing = [n for n, t in named.items() if t is None]
    if missing and len(missing) < len(named):
        names = ", ".join(named)
        fail(op, f"{', '.join(missing)} missing: give {_COUNTS.get(len(named), 'all')} {what} ({names}) or none")
    return not missing


def expect_at_least(op: str, name: str, value, low: int, why: str = "") -> None:
    """An integer argument or size that must be at least low (why: the reason, for the message)."""
    if below(value, low):
        fail(op, f"{name} must be at least {low}{why}, got {value}")


def may_overlap(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a tensor of shape and strides may have two elements at one address (writing it
    then loses values): unless each dim's stride, smallest first, passes the offsets the dims
    before it reach. Any layout a dense tensor or a view of one has passes; negative strides do not."""
    dims = sorted((st, sz) for sz, st in zip(shape, strides) if sz != 1)
    if any(sz == 0 for _, sz in dims):
        return False
    reach = 0  # the largest offset the dims taken so far address
    for stride, size in dims:
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False
