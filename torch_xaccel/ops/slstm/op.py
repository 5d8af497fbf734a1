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


def _check_state(Wx: Tensor, states) -> None:
    given = [s is not None for s in states]
    if any(given) and not all(given):
        raise ValueError("xaccel::slstm: give all four initial states (h0, c0, n0, m0) or none")
    B, _, _, NH, D = Wx.shape
    for s in states:
        if s is not None and tuple(s.shape) != (B, NH, D):
            raise ValueError(f"xaccel::slstm: an initial state must be [B, NH, D] = {[B, NH, D]}, got {list(s.shape)}")


def run(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n):
    reference.check(Wx, R, b, fresh)
    _check_state(Wx, (h0, c0, n0, m0))
    outs = runtime.dispatch(OP_NAME, case_key, reference.forward, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates,
                            clamp_n)
    return tuple(o.contiguous() for o in outs)


@torch.library.custom_op("xaccel::slstm", mutates_args=())
def slstm(Wx: Tensor, R: Tensor, b: Tensor, h0: Tensor | None, c0: Tensor | None, n0: Tensor | None,
          m0: Tensor | None, fresh: str, clamp_gates: bool, clamp_n: bool
          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Wx [B, T, 4, NH, D] (gates i, f, z, o), R [NH, 4, D, D], b [4, NH, D], optional initial
    states [B, NH, D] -> (h [B, T, NH, D], h_T, c_T, n_T, m_T); see reference.py."""
    return run(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n)


@slstm.register_fake
def _fake(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n):
    reference.check(Wx, R, b, fresh)
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
    return run_saving(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n)


def run_saving(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n):
    reference.check(Wx, R, b, fresh)
    _check_state(Wx, (h0, c0, n0, m0))
    outs = runtime.dispatch(SAVING_OP_NAME, case_key, _reference_saving, Wx, R, b, h0, c0, n0, m0, fresh,
                            clamp_gates, clamp_n)
    return tuple(o.contiguous() for o in outs)


@slstm_saving.register_fake
def _fake_saving(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n):
    kept = tuple(Wx.new_empty(shape, dtype=dtype) for shape, dtype in kept_shapes(Wx))
    return _fake(Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n) + kept


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
    return run_backward(gy, ghT, gcT, gnT, gmT, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n, y, kept)


def run_backward(gy, ghT, gcT, gnT, gmT, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n, y, kept):
    grads = runtime.dispatch(BACKWARD_OP_NAME, _backward_key, _backward_reference, gy, ghT, gcT, gnT, gmT, Wx, R, b,
                             h0, c0, n0, m0, fresh, clamp_gates, clamp_n, y, kept)
    return [g.contiguous() for g in grads]


@slstm_backward.register_fake
def _backward_fake(gy, ghT, gcT, gnT, gmT, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n, y, kept):
    return [t.new_empty(t.shape) for t in (Wx, R, b, *((h0, c0, n0, m0) if h0 is not None else ()))]


# ---- xaccel::slstm_step ------------------------------------------------------------------------

def step_case_key(Wx, R, b, h, c, n, m, fresh, clamp_gates, clamp_n) -> tuple:
    B, _, NH, D = Wx.shape
    return (Wx.device.type, Wx.dtype, B, NH, D, fresh, clamp_gates, clamp_n)


def run_step(Wx: Tensor, R: Tensor, b: Tensor, h: Tensor, c: Tensor, n: Tensor, m: Tensor, fresh: str,
             clamp_gates: bool, clamp_n: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The step op's body; compiled forward graphs call it directly (DIRECT_CALLS)."""
    reference.check(Wx.unsqueeze(1), R, b, fresh)
    outs = runtime.dispatch(STEP_OP_NAME, step_case_key, reference.step, Wx, R, b, h, c, n, m, fresh, clamp_gates,
                            clamp_n)
    return tuple(o.contiguous() for o in outs)


@torch.library.custom_op("xaccel::slstm_step", mutates_args=())
def slstm_step(Wx: Tensor, R: Tensor, b: Tensor, h: Tensor, c: Tensor, n: Tensor, m: Tensor, fresh: str,
               clamp_gates: bool, clamp_n: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Wx [B, 4, NH, D], states [B, NH, D] -> (h', c', n', m') in the compute dtype."""
    return run_step(Wx, R, b, h, c, n, m, fresh, clamp_gates, clamp_n)


@slstm_step.register_fake
def _step_fake(Wx, R, b, h, c, n, m, fresh, clamp_gates, clamp_n):
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
