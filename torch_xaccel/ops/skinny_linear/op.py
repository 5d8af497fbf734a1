"""Registration of xaccel::skinny_linear and xaccel::skinny_linear_backward (schemas, fakes,
autograd); their semantics are reference.py's. The backward saves the inputs, not their
concatenation (which the forward never builds)."""
from __future__ import annotations

import torch
from torch import Tensor

from ... import runtime
from . import reference

OP_NAME = "skinny_linear"
BACKWARD_OP_NAME = "skinny_linear_backward"


def case_key(weight, bias, xs) -> tuple:
    return (xs[0].device.type, xs[0].dtype, tuple(x.shape for x in xs), weight.shape[0], bias is not None)


def run(weight: Tensor, bias: Tensor | None, xs: list[Tensor]) -> Tensor:
    """The op's body. Compiled graphs call it directly (ops.DIRECT_CALLS)."""
    return runtime.dispatch(OP_NAME, case_key, reference.forward, weight, bias, xs)


def run_backward(dy: Tensor, weight: Tensor, xs: list[Tensor], with_bias: bool,
                 addends: list[Tensor | None]) -> list[Tensor]:
    return runtime.dispatch(BACKWARD_OP_NAME, _backward_key, reference.backward, dy, weight, xs, with_bias, addends)


def _backward_key(dy, weight, xs, with_bias, addends) -> tuple:
    return (*case_key(weight, None, xs), tuple(a is not None for a in addends))


@torch.library.custom_op("xaccel::skinny_linear", mutates_args=())
def skinny_linear(weight: Tensor, bias: Tensor | None, xs: list[Tensor]) -> Tensor:
    """weight [N, K], bias [N] or None, xs [..., K_j] (sum K_j = K, any strides) -> y [..., N]."""
    return run(weight, bias, xs)


@skinny_linear.register_fake
def _fake(weight, bias, xs):
    return xs[0].new_empty(*xs[0].shape[:-1], weight.shape[0])


@torch.library.custom_op("xaccel::skinny_linear_backward", mutates_args=())
def skinny_linear_backward(dy: Tensor, weight: Tensor, xs: list[Tensor], with_bias: bool,
                           addends: list[Tensor | None]) -> list[Tensor]:
    """[dx_j (+ addends[j], a tensor like xs[j] or None) like xs (contiguous), dweight [N, K] and
    dbias [N] (empty without a bias) in the compute dtype]. Backward graphs pass the addends
    (gradient_sums.py)."""
    return run_backward(dy, weight, xs, with_bias, addends)


@skinny_linear_backward.register_fake
def _backward_fake(dy, weight, xs, with_bias, addends):
    cd = reference.compute_dtype(weight)
    return [x.new_empty(x.shape) for x in xs] + [
        weight.new_empty(weight.shape, dtype=cd), weight.new_empty(weight.shape[0] if with_bias else 0, dtype=cd)]


def _setup_context(ctx, inputs, output):
    weight, bias, xs = inputs
    ctx.with_bias, ctx.n_xs = bias is not None, len(xs)
    ctx.save_for_backward(weight, *xs)


def _backward(ctx, dy):
    weight, *xs = ctx.saved_tensors
    *dxs, dweight, dbias = torch.ops.xaccel.skinny_linear_backward(dy, weight, xs, ctx.with_bias,
                                                                         [None] * len(xs))
    return dweight.to(weight.dtype), dbias.to(weight.dtype) if ctx.with_bias else None, dxs


skinny_linear.register_autograd(_backward, setup_context=_setup_context)

# called directly by compiled graphs (ops.DIRECT_CALLS), past the dispatcher
DIRECT_CALLS = {torch.ops.xaccel.skinny_linear.default: run,
                torch.ops.xaccel.skinny_linear_backward.default: run_backward}
