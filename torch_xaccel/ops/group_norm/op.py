"""Registration of xaccel::group_norm and xaccel::group_norm_backward (schemas, fakes, autograd);
their semantics are reference.py's. The backward recomputes each row's mean and rstd (one more
read of x) instead of saving them."""
from __future__ import annotations

import torch
from torch import Tensor

from ... import runtime
from .. import checks
from ..checks import ANY
from . import reference

OP_NAME = "group_norm"
BACKWARD_OP_NAME = "group_norm_backward"


def case_key(x, *rest) -> tuple:
    return (x.device.type, x.dtype, x.shape)


def run(x: Tensor, weight: Tensor | None, bias: Tensor | None, groups: int, eps: float) -> Tensor:
    """The op's body. Compiled graphs call it directly (ops.DIRECT_CALLS). An empty x runs the
    reference, which returns at once."""
    if x.numel() == 0:
        return reference.forward(x, weight, bias, groups, eps)
    return runtime.dispatch(OP_NAME, case_key, reference.forward, x, weight, bias, groups, eps)


def run_backward(dy: Tensor, x: Tensor, weight: Tensor | None, groups: int, eps: float,
                 with_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    args = (dy, x, weight, groups, eps, with_bias)
    dx, dw, db = reference.backward(*args) if x.numel() == 0 else runtime.dispatch(
        BACKWARD_OP_NAME, lambda dy, x, *rest: case_key(x), reference.backward, *args)
    empty = dx.new_empty(0, dtype=reference.compute_dtype(x))
    return dx, empty if dw is None else dw, empty if db is None else db


@torch.library.custom_op("xaccel::group_norm", mutates_args=())
def group_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, groups: int, eps: float) -> Tensor:
    """x [N, C] (any strides), weight and bias [C] or None -> y [N, C] contiguous, in x's dtype."""
    _validate(OP_NAME, x, groups, weight, bias)
    return run(x, weight, bias, groups, eps)


def _validate(op: str, x, groups: int, weight=None, bias=None, dy=None) -> None:
    """x [N, C] with C a multiple of groups >= 1, weight and bias [C] and dy [N, C] where given, all
    floating (any mix: the op computes in fp32, float64 for a float64 x)."""
    checks.expect_shape(op, "x", x, "[N, C]", (ANY, ANY))
    C = x.shape[1]
    checks.expect_at_least(op, "groups", groups, 1)
    if checks.differs(C % groups, 0):
        checks.fail(op, f"groups must divide x's channels C = {C}, got {groups}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            checks.expect_shape(op, name, t, "[C]", (C,))
    if dy is not None:
        checks.expect_shape(op, "dy", dy, "[N, C]", tuple(x.shape))
    checks.expect_floats(op, dict(x=x, weight=weight, bias=bias, dy=dy))


@group_norm.register_fake
def _fake(x, weight, bias, groups, eps):
    _validate(OP_NAME, x, groups, weight, bias)
    return x.new_empty(x.shape)


@torch.library.custom_op("xaccel::group_norm_backward", mutates_args=())
def group_norm_backward(dy: Tensor, x: Tensor, weight: Tensor | None, groups: int, eps: float,
                        with_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx [N, C] in x's dtype, dweight [C], dbias [C], the latter two in the compute dtype and
    empty where the forward had none)."""
    _validate(BACKWARD_OP_NAME, x, groups, weight, dy=dy)
    return run_backward(dy, x, weight, groups, eps, with_bias)


@group_norm_backward.register_fake
def _backward_fake(dy, x, weight, groups, eps, with_bias):
    _validate(BACKWARD_OP_NAME, x, groups, weight, dy=dy)
    cd = reference.compute_dtype(x)
    C = x.shape[1]
    return (x.new_empty(x.shape), x.new_empty(C if weight is not None else 0, dtype=cd),
            x.new_empty(C if with_bias else 0, dtype=cd))


def _setup_context(ctx, inputs, output):
    x, weight, bias, groups, eps = inputs
    ctx.groups, ctx.eps, ctx.with_bias = groups, eps, bias is not None
    ctx.save_for_backward(x, weight)


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw, db = torch.ops.xaccel.group_norm_backward(dy, x, weight, ctx.groups, ctx.eps, ctx.with_bias)
    return (dx, dw.to(weight.dtype) if weight is not None else None,
            db.to(x.dtype if weight is None else weight.dtype) if ctx.with_bias else None, None, None)


group_norm.register_autograd(_backward, setup_context=_setup_context)

# called directly by compiled graphs (ops.DIRECT_CALLS), past the dispatcher
DIRECT_CALLS = {torch.ops.xaccel.group_norm.default: run,
                torch.ops.xaccel.group_norm_backward.default: run_backward}
