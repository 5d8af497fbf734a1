"""Registration of xaccel::causal_conv1d and xaccel::causal_conv1d_backward (schemas, fakes,
autograd); their semantics are reference.py's."""
from __future__ import annotations

import torch
from torch import Tensor

from ... import runtime
from .. import checks
from ..checks import ANY
from . import reference

OP_NAME = "causal_conv1d"
BACKWARD_OP_NAME = "causal_conv1d_backward"


def case_key(x, w, *rest) -> tuple:
    return (x.device.type, x.dtype, x.shape, w.shape)


def run(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """The op's body. Compiled graphs call it directly (ops.DIRECT_CALLS). An empty x runs the
    reference, which returns at once."""
    if x.numel() == 0:
        return reference.forward(x, w, bias)
    return runtime.dispatch(OP_NAME, case_key, reference.forward, x, w, bias)


def run_backward(dy: Tensor, x: Tensor, w: Tensor, with_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    if x.numel() == 0:
        dx, dw, db = reference.backward(dy, x, w, with_bias)
    else:
        dx, dw, db = runtime.dispatch(BACKWARD_OP_NAME, lambda dy, x, w, wb: case_key(x, w), reference.backward,
                                      dy, x, w, with_bias)
    return dx, dw, db if db is not None else dw.new_empty(0)


def _validate(op: str, x, w, bias=None, dy=None) -> None:
    """x [B, C, S], w [C, K] with K >= 1, bias [C] and dy [B, C, S] where given, all floating (any
    mix: the op computes in fp32, float64 for a float64 x)."""
    checks.expect_shape(op, "x", x, "[B, C, S]", (ANY,) * 3)
    checks.expect_shape(op, "w", w, "[C, K]", (x.shape[1], ANY))
    checks.expect_at_least(op, "w's kernel size K", w.shape[1], 1)
    if bias is not None:
        checks.expect_shape(op, "bias", bias, "[C]", (x.shape[1],))
    if dy is not None:
        checks.expect_shape(op, "dy", dy, "[B, C, S]", tuple(x.shape))
    checks.expect_floats(op, dict(x=x, w=w, bias=bias, dy=dy))


@torch.library.custom_op("xaccel::causal_conv1d", mutates_args=())
def causal_conv1d(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x [B, C, S] (any strides), w [C, K], bias [C] or None -> y [B, C, S] in x's dtype, channels
    innermost in memory."""
    _validate(OP_NAME, x, w, bias=bias)
    return run(x, w, bias)


@causal_conv1d.register_fake
def _fake(x, w, bias):
    _validate(OP_NAME, x, w, bias=bias)
    return reference.channels_last_like(x)


@torch.library.custom_op("xaccel::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward(dy: Tensor, x: Tensor, w: Tensor, with_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx [B, C, S] like the output, dw [C, K], dbias [C], both in the compute dtype; dbias is
    empty when with_bias is False)."""
    _validate(BACKWARD_OP_NAME, x, w, dy=dy)
    return run_backward(dy, x, w, with_bias)


@causal_conv1d_backward.register_fake
def _backward_fake(dy, x, w, with_bias):
    _validate(BACKWARD_OP_NAME, x, w, dy=dy)
    cd = reference.compute_dtype(x)
    return (reference.channels_last_like(x), w.new_empty(w.shape, dtype=cd),
            w.new_empty(w.shape[0] if with_bias else 0, dtype=cd))


def _setup_context(ctx, inputs, output):
    x, w, bias = inputs
    ctx.with_bias = bias is not None
    ctx.save_for_backward(x, w)


def _backward(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw, db = torch.ops.xaccel.causal_conv1d_backward(dy, x, w, ctx.with_bias)
    return dx.to(x.dtype), dw.to(w.dtype), db.to(w.dtype) if ctx.with_bias else None


causal_conv1d.register_autograd(_backward, setup_context=_setup_context)

# called directly by compiled graphs (ops.DIRECT_CALLS), past the dispatcher
DIRECT_CALLS = {torch.ops.xaccel.causal_conv1d.default: run,
                torch.ops.xaccel.causal_conv1d_backward.default: run_backward}
