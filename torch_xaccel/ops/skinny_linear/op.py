"""Registration of xaccel::skinny_linear and xaccel::skinny_linear_backward (schemas, fakes,
autograd); their semantics are reference.py's. The backward saves the inputs, not their
concatenation (which the forward never builds)."""
from __future__ import annotations

import torch
from torch import Tensor

from ... import runtime
from .. import checks
from ..checks import ANY
from . import reference

OP_NAME = "skinny_linear"
BACKWARD_OP_NAME = "skinny_linear_backward"


def case_key(weight, bias, xs) -> tuple:
    return (xs[0].device.type, xs[0].dtype, tuple(x.shape for x in xs), weight.shape[0], bias is not None)


def _empty(weight: Tensor, xs: list[Tensor]) -> bool:
    """No rows, outputs or inputs: no kernel runs it (the reference returns at once)."""
    return weight.numel() == 0 or any(x.numel() == 0 for x in xs)


def run(weight: Tensor, bias: Tensor | None, xs: list[Tensor]) -> Tensor:
    """The op's body. Compiled graphs call it directly (ops.DIRECT_CALLS)."""
    if _empty(weight, xs):
        return reference.forward(weight, bias, xs)
    return runtime.dispatch(OP_NAME, case_key, reference.forward, weight, bias, xs)


def run_backward(dy: Tensor, weight: Tensor, xs: list[Tensor], with_bias: bool,
                 addends: list[Tensor | None]) -> list[Tensor]:
    if _empty(weight, xs):
        return reference.backward(dy, weight, xs, with_bias, addends)
    return runtime.dispatch(BACKWARD_OP_NAME, _backward_key, reference.backward, dy, weight, xs, with_bias, addends)


def _backward_key(dy, weight, xs, with_bias, addends) -> tuple:
    return (*case_key(weight, None, xs), tuple(a is not None for a in addends))


def _validate(op: str, weight, xs, bias=None, dy=None, addends=None) -> None:
    """weight [N, K]; xs [..., K_j], one or more, with equal leading dims and sum K_j = K; bias [N]
    and dy [..., N] where given; all in weight's floating dtype (F.linear's contract); addends
    where given as _validate_addends."""
    checks.expect_shape(op, "weight", weight, "[N, K]", (ANY, ANY))
    checks.expect_float(op, "weight", weight)
    N, K = weight.shape
    if not xs:
        checks.fail(op, "xs must hold at least one input")
    checks.expect_rank(op, "xs[0]", xs[0], "[..., K_0]", 1)
    lead = tuple(xs[0].shape[:-1])
    for j, x in enumerate(xs):
        checks.expect_shape(op, f"xs[{j}]", x, f"[..., K_{j}] with xs[0]'s leading dims", (*lead, ANY))
        checks.expect_dtype(op, f"xs[{j}]", x, weight.dtype, "weight")
    if checks.differs(sum(x.shape[-1] for x in xs), K):
        checks.fail(op, f"xs's last dims must add up to weight's K = {K}, got {[x.shape[-1] for x in xs]}")
    for name, t, layout, shape in (("bias", bias, "[N]", (N,)), ("dy", dy, "[..., N]", (*lead, N))):
        if t is not None:
            checks.expect_shape(op, name, t, layout, shape)
            checks.expect_dtype(op, name, t, weight.dtype, "weight")
    if addends is not None:
        _validate_addends(op, xs, addends)


def _validate_addends(op: str, xs, addends) -> None:
    """One entry per input: None, or a tensor of that input's shape and dtype (added to its gradient)."""
    if len(addends) != len(xs):
        checks.fail(op, f"addends must hold one entry (a tensor or None) per input ({len(xs)}), got {len(addends)}")
    for j, (a, x) in enumerate(zip(addends, xs)):
        if a is not None:
            checks.expect_shape(op, f"addends[{j}]", a, f"like xs[{j}]", tuple(x.shape))
            checks.expect_dtype(op, f"addends[{j}]", a, x.dtype, f"xs[{j}]")


@torch.library.custom_op("xaccel::skinny_linear", mutates_args=())
def skinny_linear(weight: Tensor, bias: Tensor | None, xs: list[Tensor]) -> Tensor:
    """weight [N, K], bias [N] or None, xs [..., K_j] (sum K_j = K, any strides) -> y [..., N]."""
    _validate(OP_NAME, weight, xs, bias=bias)
    return run(weight, bias, xs)


@skinny_linear.register_fake
def _fake(weight, bias, xs):
    _validate(OP_NAME, weight, xs, bias=bias)
    return xs[0].new_empty(*xs[0].shape[:-1], weight.shape[0])


@torch.library.custom_op("xaccel::skinny_linear_backward", mutates_args=())
def skinny_linear_backward(dy: Tensor, weight: Tensor, xs: list[Tensor], with_bias: bool,
                           addends: list[Tensor | None]) -> list[Tensor]:
    """[dx_j (+ addends[j], a tensor like xs[j] or None) like xs (contiguous), dweight [N, K] and
    dbias [N] (empty without a bias) in the compute dtype]. Backward graphs pass the addends
    (gradient_sums.py)."""
    _validate(BACKWARD_OP_NAME, weight, xs, dy=dy, addends=addends)
    return run_backward(dy, weight, xs, with_bias, addends)


@skinny_linear_backward.register_fake
def _backward_fake(dy, weight, xs, with_bias, addends):
    _validate(BACKWARD_OP_NAME, weight, xs, dy=dy, addends=addends)
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
