"""Registration of xaccel::headwise and xaccel::headwise_weight_grad (schemas, fakes, autograd);
their semantics are reference.py's. The backward is two ops: the input gradient is the op itself
with w transposed per head ([H, D, O]), the weight gradient a reduction over the rows."""
from __future__ import annotations

import torch
from torch import Tensor

from ... import runtime
from .. import checks
from ..checks import ANY
from . import reference

OP_NAME = "headwise"
WEIGHT_GRAD_OP_NAME = "headwise_weight_grad"


def case_key(x, w, addend=None) -> tuple:
    return (x.device.type, x.dtype, x.shape, w.shape, addend is not None)


def _empty(x: Tensor, other: Tensor) -> bool:
    """No rows, heads or block (x, or w or dy, empty): no kernel runs it (the reference returns at
    once)."""
    return x.numel() == 0 or other.numel() == 0


def run(x: Tensor, w: Tensor, addend: Tensor | None = None) -> Tensor:
    """The op's body. Compiled graphs call it directly (ops.DIRECT_CALLS): a small projection's
    kernels are short, and the custom-op layer's host time would be of their order."""
    if _empty(x, w):
        return reference.forward(x, w, addend).contiguous()
    return runtime.dispatch(OP_NAME, case_key, reference.forward, x, w, addend).contiguous()


def run_weight_grad(dy: Tensor, x: Tensor) -> Tensor:
    if _empty(x, dy):
        return reference.weight_grad(dy, x).contiguous()
    return runtime.dispatch(WEIGHT_GRAD_OP_NAME, case_key, reference.weight_grad, dy, x).contiguous()


def _validate(x, w, addend) -> None:
    """x [..., H, D] and w [H, O, D] floating (any mix: the op computes in fp32, float64 for a
    float64 x); addend [..., H, O] in x's dtype, which the result has."""
    checks.expect_rank(OP_NAME, "x", x, "[..., H, D]", 2)
    H, D = x.shape[-2:]
    checks.expect_shape(OP_NAME, "w", w, "[H, O, D]", (H, ANY, D))
    checks.expect_floats(OP_NAME, dict(x=x, w=w))
    if addend is not None:
        checks.expect_shape(OP_NAME, "addend", addend, "[..., H, O]", (*x.shape[:-1], w.shape[1]))
        checks.expect_dtype(OP_NAME, "addend", addend, x.dtype, "x")


@torch.library.custom_op("xaccel::headwise", mutates_args=())
def headwise(x: Tensor, w: Tensor, addend: Tensor | None = None) -> Tensor:
    """x [..., H, D], w [H, O, D] (any strides), addend [..., H, O] or None -> y [..., H, O] (+
    addend), contiguous, in x's dtype. Backward graphs pass the addend (gradient_sums.py)."""
    _validate(x, w, addend)
    return run(x, w, addend)


@headwise.register_fake
def _fake(x, w, addend=None):
    _validate(x, w, addend)
    return x.new_empty(*x.shape[:-1], w.shape[1])


def _validate_weight_grad(dy, x) -> None:
    """dy [..., H, O] and x [..., H, D] floating, with the same leading dims and heads."""
    op = WEIGHT_GRAD_OP_NAME
    checks.expect_rank(op, "x", x, "[..., H, D]", 2)
    checks.expect_shape(op, "dy", dy, "[..., H, O]", (*x.shape[:-1], ANY))
    checks.expect_floats(op, dict(dy=dy, x=x))


@torch.library.custom_op("xaccel::headwise_weight_grad", mutates_args=())
def headwise_weight_grad(dy: Tensor, x: Tensor) -> Tensor:
    """dy [..., H, O], x [..., H, D] -> dw [H, O, D] in the compute dtype (fp32 for fp16/bf16)."""
    _validate_weight_grad(dy, x)
    return run_weight_grad(dy, x)


@headwise_weight_grad.register_fake
def _weight_grad_fake(dy, x):
    _validate_weight_grad(dy, x)
    return x.new_empty(x.shape[-2], dy.shape[-1], x.shape[-1], dtype=reference.compute_dtype(x))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:2])


def _backward(ctx, dy):
    x, w = ctx.saved_tensors
    dx = torch.ops.xaccel.headwise(dy, w.transpose(1, 2)) if ctx.needs_input_grad[0] else None
    dw = torch.ops.xaccel.headwise_weight_grad(dy, x).to(w.dtype) if ctx.needs_input_grad[1] else None
    if len(ctx.needs_input_grad) == 2:  # called without the addend
        return dx, dw
    return dx, dw, dy if ctx.needs_input_grad[2] else None


headwise.register_autograd(_backward, setup_context=_setup_context)

# called directly by compiled graphs (ops.DIRECT_CALLS), past the dispatcher
DIRECT_CALLS = {torch.ops.xaccel.headwise.default: run,
                torch.ops.xaccel.headwise_weight_grad.default: run_weight_grad}
