"""Registration of the sLSTM ops (schemas, fakes, autograd); their semantics are reference.py's.

xaccel::slstm (a sequence), xaccel::slstm_saving (the same op also returning what its backward
kernels read, for training graphs), xaccel::slstm_backward (its backward as one opaque op, so that a
traced backward graph holds one node whose kernel is picked at run time) and xaccel::slstm_step
(one step, for decoding).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ... import runtime
from .. import checks
from ..recompute import recompute_grads
from . import reference, reference_backward
from .reference import compute_dtype

OP_NAME = "slstm"
SAVING_OP_NAME = "slstm_saving"
BACKWARD_OP_NAME = "slstm_backward"
STEP_OP_NAME = "slstm_step"


def case_key(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n) -> tuple:
    B, T, _, NH, D = Wx.shape
    return (Wx.device.type, Wx.dtype, B, T, NH, D, h0 is not None, fresh, clamp_gates, clamp_n)


STATES = ("h0", "c0", "n0", "m0")


def _validate(op: str, Wx, R, b, states, fresh) -> None:
    """The sequence ops' contract: reference.check's, and the four initial states [B, NH, D]
    (floating) all given or none."""
    reference.check(Wx, R, b, fresh, op)
    B, _, _, NH, D = Wx.shape
    named = dict(zip(STATES, states))
    checks.all_or_none(op, named, "initial states")
    _validate_states(op, named, (B, NH, D))


def _validate_states(op: str, named: dict, shape: tuple) -> None:
    """Each given tensor of {name: tensor or None} is a floating [B, NH, D] = shape."""
    for name, t in named.items():
        if t is not None:
            checks.expect_shape(op, name, t, "[B, NH, D]", shape)
            checks.expect_float(op, name, t)


def _empty(Wx: Tensor) -> bool:
    """An empty batch, sequence or head: no kernel runs it (the reference returns at once)."""
    return Wx.numel() == 0


def run(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n):
    args = (Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n)
    outs = reference.forward(*args) if _empty(Wx) else runtime.dispatch(OP_NAME, case_key, reference.forward,
                                                                        *args)
    return tuple(o.contiguous() for o in outs)


@torch.library.custom_op("xaccel::slstm", mutates_args=())
def slstm(Wx: Tensor, R: Tensor, b: Tensor, h0: Tensor | None, c0: Tensor | None, n0: Tensor | None,
          m0: Tensor | None, fresh: str, clamp_gates: bool, clamp_n: bool
          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Wx [B, T, 4, NH, D] (gates i, f, z, o), R [NH, 4, D, D], b [4, NH, D], optional initial
    states [B, NH, D] -> (h [B, T, NH, D], h_T, c_T, n_T, m_T); see reference.py."""
    _validate(OP_NAME, Wx, R, b, (h0, c0, n0, m0), fresh)
    return run(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n)


@slstm.register_fake
def _fake(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n):
    _validate(OP_NAME, Wx, R, b, (h0, c0, n0, m0), fresh)
    return _fake_outputs(Wx)


def _fake_outputs(Wx) -> tuple:
    B, T, _, NH, D = Wx.shape
    cd = compute_dtype(Wx)
    final = [Wx.new_empty(B, NH, D, dtype=cd) for _ in range(4)]
    return (Wx.new_empty(B, T, NH, D), *final)


def kept_shapes(Wx) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What xaccel::slstm_saving keeps for the backward kernels: every step's pre-activations
    [B, T, 4, NH, D] and state after the step (c, n, m) [3, B, T, NH, D], in the compute dtype."""
    B, T, _, NH, D = Wx.shape
    cd = compute_dtype(Wx)
    return [((B, T, 4, NH, D), cd), ((3, B, T, NH, D), cd)]


def _reference_saving(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n):
    out = reference.forward(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n)
    raw, cnm = reference_backward.kept_states(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n)
    return (*out, raw, cnm)


@torch.library.custom_op("xaccel::slstm_saving", mutates_args=())
def slstm_saving(Wx: Tensor, R: Tensor, b: Tensor, h0: Tensor | None, c0: Tensor | None, n0: Tensor | None,
                 m0: Tensor | None, fresh: str, clamp_gates: bool, clamp_n: bool
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """xaccel::slstm plus what its backward kernels read (kept_shapes): the op a training graph
    runs, so that the backward does not run the forward again."""
    _validate(SAVING_OP_NAME, Wx, R, b, (h0, c0, n0, m0), fresh)
    return run_saving(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n)


def run_saving(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n):
    args = (Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n)
    outs = _reference_saving(*args) if _empty(Wx) else runtime.dispatch(SAVING_OP_NAME, case_key,
                                                                        _reference_saving, *args)
    return tuple(o.contiguous() for o in outs)


@slstm_saving.register_fake
def _fake_saving(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n):
    _validate(SAVING_OP_NAME, Wx, R, b, (h0, c0, n0, m0), fresh)
    kept = tuple(Wx.new_empty(shape, dtype=dtype) for shape, dtype in kept_shapes(Wx))
    return _fake_outputs(Wx) + kept


def _setup_context(ctx, inputs, output):
    Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n = inputs
    ctx.has_state = h0 is not None
    ctx.variant = (fresh, clamp_gates, clamp_n)
    kept = tuple(output[5:7]) if len(output) > 5 else ()
    if kept:
        ctx.mark_non_differentiable(*kept)
    ctx.n_kept = len(kept)
    ctx.save_for_backward(Wx, R, b, output[0], *kept, *((h0, c0, n0, m0) if ctx.has_state else ()))
    ctx.set_materialize_grads(False)


def _backward(ctx, gy, ghT, gcT, gnT, gmT, *_kept_grads):
    Wx, R, b, y, *rest = ctx.saved_tensors
    kept, state = rest[:ctx.n_kept], rest[ctx.n_kept:]
    state = state if ctx.has_state else [None] * 4
    grads = torch.ops.xaccel.slstm_backward(gy, ghT, gcT, gnT, gmT, Wx, R, b, *state, *ctx.variant, y, kept)
    return (*grads, *([None] * (7 - len(grads))), None, None, None)


slstm.register_autograd(_backward, setup_context=_setup_context)
slstm_saving.register_autograd(_backward, setup_context=_setup_context)


def _backward_reference(gy, ghT, gcT, gnT, gmT, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n, y, kept):
    return reference_backward.backward(gy, ghT, gcT, gnT, gmT, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n)


def _backward_key(gy, ghT, gcT, gnT, gmT, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n, y, kept) -> tuple:
    return case_key(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n) + (bool(kept),)


@torch.library.custom_op("xaccel::slstm_backward", mutates_args=())
def slstm_backward(gy: Tensor | None, ghT: Tensor | None, gcT: Tensor | None, gnT: Tensor | None,
                   gmT: Tensor | None, Wx: Tensor, R: Tensor, b: Tensor, h0: Tensor | None, c0: Tensor | None,
                   n0: Tensor | None, m0: Tensor | None, fresh: str, clamp_gates: bool, clamp_n: bool,
                   y: Tensor, kept: list[Tensor]) -> list[Tensor]:
    """[dWx, dR, db] (+ [dh0, dc0, dn0, dm0] with an initial state), each contiguous in its
    input's shape. y: the forward's output (the kernels read h_{t-1} from it); kept: [] or
    xaccel::slstm_saving's kept states (else the kernels run the forward again to get them)."""
    _validate_backward(gy, (ghT, gcT, gnT, gmT), Wx, R, b, (h0, c0, n0, m0), fresh, y, kept)
    return run_backward(gy, ghT, gcT, gnT, gmT, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n, y, kept)


def _validate_backward(gy, final_grads, Wx, R, b, states, fresh, y, kept) -> None:
    """The forward's contract, plus gy and y [B, T, NH, D], the final state's gradients
    [B, NH, D] and kept as xaccel::slstm_saving's kept states (kept_shapes)."""
    op = BACKWARD_OP_NAME
    _validate(op, Wx, R, b, states, fresh)
    B, T, _, NH, D = Wx.shape
    _validate_states(op, dict(zip(("ghT", "gcT", "gnT", "gmT"), final_grads)), (B, NH, D))
    for name, t in (("gy", gy), ("y", y)):
        if t is not None:
            checks.expect_shape(op, name, t, "[B, T, NH, D]", (B, T, NH, D))
            checks.expect_float(op, name, t)
    if not kept:
        return
    if len(kept) != 2:
        checks.fail(op, f"kept must be [] or xaccel::slstm_saving's 2 kept tensors, got {len(kept)}")
    for j, (t, (shape, _), layout) in enumerate(zip(kept, kept_shapes(Wx), ("[B, T, 4, NH, D]", "[3, B, T, NH, D]"))):
        checks.expect_shape(op, f"kept[{j}]", t, layout, shape)
        checks.expect_float(op, f"kept[{j}]", t)


def run_backward(gy, ghT, gcT, gnT, gmT, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n, y, kept):
    args = (gy, ghT, gcT, gnT, gmT, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n, y, kept)
    grads = _backward_reference(*args) if _empty(Wx) else runtime.dispatch(BACKWARD_OP_NAME, _backward_key,
                                                                           _backward_reference, *args)
    return [g.contiguous() for g in grads]


@slstm_backward.register_fake
def _backward_fake(gy, ghT, gcT, gnT, gmT, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n, y, kept):
    _validate_backward(gy, (ghT, gcT, gnT, gmT), Wx, R, b, (h0, c0, n0, m0), fresh, y, kept)
    return [t.new_empty(t.shape) for t in (Wx, R, b, *((h0, c0, n0, m0) if h0 is not None else ()))]


# ---- xaccel::slstm_step ------------------------------------------------------------------------

def step_case_key(Wx, R, b, h, c, n, m, fresh, clamp_gates, clamp_n) -> tuple:
    B, _, NH, D = Wx.shape
    return (Wx.device.type, Wx.dtype, B, NH, D, fresh, clamp_gates, clamp_n)


def run_step(Wx: Tensor, R: Tensor, b: Tensor, h: Tensor, c: Tensor, n: Tensor, m: Tensor, fresh: str,
             clamp_gates: bool, clamp_n: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The step op's body; compiled forward graphs call it directly (DIRECT_CALLS)."""
    args = (Wx, R, b, h, c, n, m, fresh, clamp_gates, clamp_n)
    outs = reference.step(*args) if _empty(Wx) else runtime.dispatch(STEP_OP_NAME, step_case_key, reference.step,
                                                                     *args)
    return tuple(o.contiguous() for o in outs)


def _validate_step(Wx, R, b, states, fresh) -> None:
    """reference.check's contract for one step's Wx [B, 4, NH, D], and the states [B, NH, D]."""
    reference.check(Wx, R, b, fresh, STEP_OP_NAME)
    B, _, NH, D = Wx.shape
    _validate_states(STEP_OP_NAME, dict(zip("hcnm", states)), (B, NH, D))


@torch.library.custom_op("xaccel::slstm_step", mutates_args=())
def slstm_step(Wx: Tensor, R: Tensor, b: Tensor, h: Tensor, c: Tensor, n: Tensor, m: Tensor, fresh: str,
               clamp_gates: bool, clamp_n: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Wx [B, 4, NH, D], states [B, NH, D] -> (h', c', n', m') in the compute dtype."""
    _validate_step(Wx, R, b, (h, c, n, m), fresh)
    return run_step(Wx, R, b, h, c, n, m, fresh, clamp_gates, clamp_n)


@slstm_step.register_fake
def _step_fake(Wx, R, b, h, c, n, m, fresh, clamp_gates, clamp_n):
    _validate_step(Wx, R, b, (h, c, n, m), fresh)
    return tuple(h.new_empty(h.shape, dtype=compute_dtype(Wx)) for _ in range(4))


def _step_setup_context(ctx, inputs, output):
    *tensors, fresh, clamp_gates, clamp_n = inputs
    ctx.save_for_backward(*tensors)
    ctx.variant = (fresh, clamp_gates, clamp_n)


def _step_backward(ctx, gh, gc, gn, gm):
    grads = recompute_grads(lambda *t: reference.step(*t, *ctx.variant), list(ctx.saved_tensors), [gh, gc, gn, gm])
    return (*grads, None, None, None)


slstm_step.register_autograd(_step_backward, setup_context=_step_setup_context)

# called directly by compiled graphs (ops.DIRECT_CALLS), past the dispatcher: through it, a
# training step's calls of these ops cost more host time than their kernels take (docs/benchmarks.md)
DIRECT_CALLS = {torch.ops.xaccel.slstm.default: run,
                torch.ops.xaccel.slstm_saving.default: run_saving,
                torch.ops.xaccel.slstm_backward.default: run_backward,
                torch.ops.xaccel.slstm_step.default: run_step}
