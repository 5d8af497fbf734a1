"""Registration of the mLSTM ops (schemas, fakes, autograd); their semantics are reference.py's.

xaccel::mlstm, xaccel::mlstm_saving (the same op also returning the state entering each chunk,
which its backward reads), xaccel::mlstm_backward (that backward as one opaque op) and
xaccel::mlstm_step (one recurrent step, for decoding).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ... import runtime
from .. import checks
from ..checks import ANY
from ..recompute import recompute_grads
from . import reference, reference_backward
from .reference import compute_dtype, kept_shapes

OP_NAME = "mlstm"
SAVING_OP_NAME = "mlstm_saving"


def case_key(q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h=False) -> tuple:
    return (q.device.type, q.dtype, q.shape, v.shape, C0 is not None, seq_major_h)


def _reference(q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h=False):
    return reference.forward(q, k, v, i, f, C0, n0, m0, eps, chunk_size)


def _reference_saving(q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h=False):
    return reference.forward(q, k, v, i, f, C0, n0, m0, eps, chunk_size, save=True)


def _validate(op: str, q, k, v, i, f, C0, n0, m0, chunk_size) -> None:
    """The sequence ops' contract: q, k [B, H, S, DK] and v [B, H, S, DV] of one floating dtype (the
    kernels compute them as one), gates [B, H, S], and (C0 [B, H, DK, DV], n0 [B, H, DK], m0 [B, H])
    all given or none."""
    checks.expect_shape(op, "q", q, "[B, H, S, DK]", (ANY,) * 4)
    B, H, S, DK = q.shape
    checks.expect_shape(op, "k", k, "[B, H, S, DK]", (B, H, S, DK))
    checks.expect_shape(op, "v", v, "[B, H, S, DV]", (B, H, S, ANY))
    DV = v.shape[3]
    checks.expect_shape(op, "i", i, "[B, H, S]", (B, H, S))
    checks.expect_shape(op, "f", f, "[B, H, S]", (B, H, S))
    if checks.all_or_none(op, dict(C0=C0, n0=n0, m0=m0), "initial states"):
        checks.expect_shape(op, "C0", C0, "[B, H, DK, DV]", (B, H, DK, DV))
        checks.expect_shape(op, "n0", n0, "[B, H, DK]", (B, H, DK))
        checks.expect_shape(op, "m0", m0, "[B, H]", (B, H))
    checks.expect_floats(op, dict(q=q, k=k, v=v, i=i, f=f, C0=C0, n0=n0, m0=m0))
    checks.expect_dtype(op, "k", k, q.dtype, "q")
    checks.expect_dtype(op, "v", v, q.dtype, "q")
    checks.expect_at_least(op, "q's head dim DK", DK, 1, " (k is scaled by 1/sqrt(DK))")
    checks.expect_at_least(op, "chunk_size", chunk_size, 1)


def h_like(q: Tensor, v: Tensor, seq_major_h: bool) -> Tensor:
    """An empty h [B, H, S, DV] in the layout the op promises: contiguous, or with seq_major_h
    the [B, H, S, DV] view of a contiguous [B, S, H, DV] (what h.transpose(1, 2).reshape(B, S, -1),
    the usual next step, then reads as a view instead of copying)."""
    B, H, S = q.shape[:3]
    if seq_major_h:
        return q.new_empty(B, S, H, v.shape[-1]).transpose(1, 2)
    return q.new_empty(B, H, S, v.shape[-1])


def _promised(outs, q, v, seq_major_h: bool) -> tuple:
    """The outputs as the fake function promises them whatever path ran: h in h_like's layout,
    the rest contiguous."""
    h = outs[0]
    if seq_major_h and h.transpose(1, 2).is_contiguous() or not seq_major_h and h.is_contiguous():
        return (h, *(o.contiguous() for o in outs[1:]))
    return (h_like(q, v, seq_major_h).copy_(h), *(o.contiguous() for o in outs[1:]))


def _empty(q: Tensor, v: Tensor) -> bool:
    """An empty batch, sequence or value head: no kernel runs it (the reference returns at once)."""
    return q.numel() == 0 or v.numel() == 0


def run(q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h=False):
    args = (q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h)
    outs = _reference(*args) if _empty(q, v) else runtime.dispatch(OP_NAME, case_key, _reference, *args)
    return _promised(outs, q, v, seq_major_h)


@torch.library.custom_op("xaccel::mlstm", mutates_args=())
def mlstm(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C0: Tensor | None, n0: Tensor | None,
          m0: Tensor | None, eps: float, chunk_size: int, seq_major_h: bool = False
          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """seq_major_h: h's memory is [B, S, H, DV] (h_like); the graph pass sets it where every
    reader of h transposes it to that order first (lowering/mlstm/h_layout.py)."""
    _validate(OP_NAME, q, k, v, i, f, C0, n0, m0, chunk_size)
    return run(q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h)


@torch.library.custom_op("xaccel::mlstm_saving", mutates_args=())
def mlstm_saving(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C0: Tensor | None, n0: Tensor | None,
                 m0: Tensor | None, eps: float, chunk_size: int, seq_major_h: bool = False
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """xaccel::mlstm plus the state entering each chunk (C, n, m per chunk) and each row's den and
    m (kept_shapes), which its backward reads instead of recomputing them: the op a
    training graph runs where the kernels' backward reads them. Those and the final state are
    saved for the backward, so modifying any of them in place before it raises autograd's version
    error (as for any saved output)."""
    _validate(SAVING_OP_NAME, q, k, v, i, f, C0, n0, m0, chunk_size)
    return run_saving(q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h)


def run_saving(q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h=False):
    args = (q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h)
    outs = _reference_saving(*args) if _empty(q, v) else runtime.dispatch(SAVING_OP_NAME, case_key,
                                                                          _reference_saving, *args)
    return _promised(outs, q, v, seq_major_h)


@mlstm.register_fake
def _fake(q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h=False):
    _validate(OP_NAME, q, k, v, i, f, C0, n0, m0, chunk_size)
    return _fake_outputs(q, v, seq_major_h)


def _fake_outputs(q, v, seq_major_h: bool) -> tuple:
    B, H, S, DK = q.shape
    cd = compute_dtype(q)
    return (h_like(q, v, seq_major_h), q.new_empty(B, H, DK, v.shape[-1], dtype=cd),
            q.new_empty(B, H, DK, dtype=cd), q.new_empty(B, H, dtype=cd))


@mlstm_saving.register_fake
def _fake_saving(q, k, v, i, f, C0, n0, m0, eps, chunk_size, seq_major_h=False):
    _validate(SAVING_OP_NAME, q, k, v, i, f, C0, n0, m0, chunk_size)
    kept = tuple(q.new_empty(shape, dtype=dtype) for shape, dtype in kept_shapes(q, v, chunk_size))
    return _fake_outputs(q, v, seq_major_h) + kept


def _setup_context(ctx, inputs, output):
    q, k, v, i, f, C0, n0, m0, eps, chunk_size, _seq_major_h = inputs
    ctx.has_state = C0 is not None
    # the output h too: the backward kernels read h . dh instead of recomputing the numerator;
    # with kept chunk states, those and the final state (the backward's scan needs neither rerun)
    kept = tuple(output[4:8]) + tuple(output[1:4]) if len(output) > 4 else ()
    if kept:
        ctx.mark_non_differentiable(*output[4:8])  # saved for the backward, not results
    ctx.n_kept = len(kept)
    ctx.save_for_backward(q, k, v, i, f, output[0], *kept, *((C0, n0, m0) if ctx.has_state else ()))
    ctx.eps, ctx.chunk_size = eps, chunk_size
    ctx.set_materialize_grads(False)  # unused final states get None: the backward skips them


def _backward_reference(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size, h, kept):
    return reference_backward.backward(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps=eps, chunk_size=chunk_size)


def _backward_key(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size, h, kept) -> tuple:
    return (q.device.type, q.dtype, q.shape, v.shape, C0 is not None, bool(kept))


def gradient_strides(t: Tensor) -> tuple[int, ...]:
    """The strides of the gradient xaccel::mlstm_backward returns for input t: t's own when t is
    a dense [B, H, S, D] with unit stride along D (the usual transposed projection, [B, S, H, D]
    seen as [B, H, S, D]: its gradient then flows back through the transpose and the reshape as
    a view, where a contiguous one costs a copy per input and layer), else contiguous. The fake
    and every path of the backward follow this one rule, so that they agree."""
    if t.dim() == 4 and t.stride(-1) == 1 and _dense(t):
        return tuple(t.stride())
    strides, step = [], 1
    for d in reversed(t.shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _dense(t: Tensor) -> bool:
    """Whether t's elements fill one block of memory without gaps or overlaps, in any dim order."""
    step = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != step:
            return False
        step *= size
    return True


def gradient_like(t: Tensor) -> Tensor:
    """An empty gradient buffer for input t, in gradient_strides(t)."""
    return t.new_empty_strided(t.shape, gradient_strides(t))


def _in_gradient_layout(g: Tensor, t: Tensor) -> Tensor:
    """g as the fake promises it: the kernels write q, k, v's gradients in gradient_strides
    already; the reference's (and a copied input's) are copied into that layout."""
    if g.stride() == gradient_strides(t):
        return g
    out = gradient_like(t)
    out.copy_(g)
    return out


@torch.library.custom_op("xaccel::mlstm_backward", mutates_args=())
def mlstm_backward(gh: Tensor | None, gC: Tensor | None, gn: Tensor | None, gm: Tensor | None, q: Tensor, k: Tensor,
                   v: Tensor, i: Tensor, f: Tensor, C0: Tensor | None, n0: Tensor | None, m0: Tensor | None,
                   eps: float, chunk_size: int, h: Tensor | None, kept: list[Tensor]) -> list[Tensor]:
    """xaccel::mlstm's backward as one opaque op, so that traced backward graphs hold a single
    node whose kernel is picked at run time: [dq, dk, dv, di, df] (+ [dC0, dn0, dm0] with a state).
    h: the forward's output, when saved (the kernels use it; the reference does not need it).
    kept: [] or xaccel::mlstm_saving's kept states and row terms and its final state
    [Cs, ns, ms, rows, C, n, m] (the kernels skip their state scan and q k^T for the row terms
    when their chunk length is chunk_size)."""
    _validate_backward(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, chunk_size, h, kept)
    return run_backward(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size, h, kept)


def _validate_backward(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, chunk_size, h, kept) -> None:
    """The forward's contract, plus the output gradients and h shaped as the forward's outputs and
    kept as xaccel::mlstm_saving's kept states and final state (kept_shapes)."""
    op = "mlstm_backward"
    _validate(op, q, k, v, i, f, C0, n0, m0, chunk_size)
    B, H, S, DK = q.shape
    DV = v.shape[3]
    final = [("[B, H, DK, DV]", (B, H, DK, DV)), ("[B, H, DK]", (B, H, DK)), ("[B, H]", (B, H))]
    for name, t, (layout, shape) in zip(("gh", "h", "gC", "gn", "gm"), (gh, h, gC, gn, gm),
                                        [("[B, H, S, DV]", (B, H, S, DV))] * 2 + final):
        if t is not None:
            checks.expect_shape(op, name, t, layout, shape)
            checks.expect_float(op, name, t)
    if not kept:
        return
    layouts = ("[B, H, NC, DK, DV]", "[B, H, NC, DK]", "[B, H, NC]", "[B, H, 2, S]")
    want = [(layout, shape) for layout, (shape, _) in zip(layouts, kept_shapes(q, v, chunk_size))] + final
    if len(kept) != len(want):
        checks.fail(op, f"kept must be [] or xaccel::mlstm_saving's {len(want)} kept tensors "
                        f"[Cs, ns, ms, rows, C, n, m], got {len(kept)}")
    for j, (t, (layout, shape)) in enumerate(zip(kept, want)):
        checks.expect_shape(op, f"kept[{j}]", t, layout, shape)
        checks.expect_float(op, f"kept[{j}]", t)


def run_backward(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size, h, kept):
    args = (gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size, h, kept)
    grads = _backward_reference(*args) if _empty(q, v) else runtime.dispatch(
        "mlstm_backward", _backward_key, _backward_reference, *args)
    dqkv = [_in_gradient_layout(g, t) for g, t in zip(grads[:3], (q, k, v))]
    return dqkv + [g.contiguous() for g in grads[3:] if g is not None]


@mlstm_backward.register_fake
def _backward_fake(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, eps, chunk_size, h, kept):
    _validate_backward(gh, gC, gn, gm, q, k, v, i, f, C0, n0, m0, chunk_size, h, kept)
    # dq, dk, dv in gradient_strides (their input's layout when dense), the rest contiguous
    return [gradient_like(t) for t in (q, k, v)] + [t.new_empty(t.shape) for t in
                                                    (i, f, *((C0, n0, m0) if C0 is not None else ()))]


def _backward(ctx, gh, gC, gn, gm, *_kept_grads):
    saved = list(ctx.saved_tensors)
    kept, rest = saved[6:6 + ctx.n_kept], saved[6 + ctx.n_kept:]
    state = rest if ctx.has_state else [None, None, None]
    grads = torch.ops.xaccel.mlstm_backward(gh, gC, gn, gm, *saved[:5], *state, ctx.eps, ctx.chunk_size, saved[5],
                                            kept)
    return (*grads, *([None] * (8 - len(grads))), None, None, None)


mlstm.register_autograd(_backward, setup_context=_setup_context)
mlstm_saving.register_autograd(_backward, setup_context=_setup_context)


# ---- xaccel::mlstm_step ------------------------------------------------------------------------

STEP_OP_NAME = "mlstm_step"


def step_case_key(q, k, v, i, f, C, n, m, eps, scale_q) -> tuple:
    return (q.device.type, q.dtype, q.shape, v.shape)


def run_step(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C: Tensor, n: Tensor, m: Tensor,
             eps: float, scale_q: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's body: the kernel if it takes the case, else the reference. Compiled forward graphs
    call this directly (ops.DIRECT_CALLS): the custom-op layer is a large part of a decode step's
    host time."""
    args = (q, k, v, i, f, C, n, m, eps, scale_q)
    outs = reference.step(*args) if _empty(q, v) else runtime.dispatch(STEP_OP_NAME, step_case_key,
                                                                       reference.step, *args)
    return tuple(o.contiguous() for o in outs)  # as the fake function promises


def _validate_step(q, k, v, i, f, C, n, m) -> None:
    """q, k [B, H, DK], v [B, H, DV], gates [B, H], states C [B, H, DK, DV], n [B, H, DK], m [B, H],
    all floating (any mix: the step computes in fp32, or float64 for a float64 q)."""
    op = STEP_OP_NAME
    checks.expect_shape(op, "q", q, "[B, H, DK]", (ANY,) * 3)
    B, H, DK = q.shape
    checks.expect_shape(op, "k", k, "[B, H, DK]", (B, H, DK))
    checks.expect_shape(op, "v", v, "[B, H, DV]", (B, H, ANY))
    DV = v.shape[2]
    checks.expect_shape(op, "i", i, "[B, H]", (B, H))
    checks.expect_shape(op, "f", f, "[B, H]", (B, H))
    checks.expect_shape(op, "C", C, "[B, H, DK, DV]", (B, H, DK, DV))
    checks.expect_shape(op, "n", n, "[B, H, DK]", (B, H, DK))
    checks.expect_shape(op, "m", m, "[B, H]", (B, H))
    checks.expect_floats(op, dict(q=q, k=k, v=v, i=i, f=f, C=C, n=n, m=m))
    checks.expect_at_least(op, "q's head dim DK", DK, 1, " (k or q is scaled by 1/sqrt(DK))")


@torch.library.custom_op("xaccel::mlstm_step", mutates_args=())
def mlstm_step(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C: Tensor, n: Tensor, m: Tensor,
               eps: float, scale_q: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _validate_step(q, k, v, i, f, C, n, m)
    return run_step(q, k, v, i, f, C, n, m, eps, scale_q)


@mlstm_step.register_fake
def _step_fake(q, k, v, i, f, C, n, m, eps, scale_q=False):
    _validate_step(q, k, v, i, f, C, n, m)
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (q.new_empty(v.shape), C.new_empty(C.shape, dtype=cd), n.new_empty(n.shape, dtype=cd),
            m.new_empty(m.shape, dtype=cd))


def _step_setup_context(ctx, inputs, output):
    *tensors, eps, scale_q = inputs
    ctx.save_for_backward(*tensors)
    ctx.eps, ctx.scale_q = eps, scale_q


def _step_backward(ctx, gh, gC, gn, gm):
    grads = recompute_grads(lambda *t: reference.step(*t, eps=ctx.eps, scale_q=ctx.scale_q), list(ctx.saved_tensors),
                             [gh, gC, gn, gm])
    return (*grads, None, None)


mlstm_step.register_autograd(_step_backward, setup_context=_step_setup_context)

# called directly by compiled graphs (ops.DIRECT_CALLS), past the dispatcher: through it, a
# training step's calls of these ops cost more host time than their kernels take (docs/benchmarks.md)
DIRECT_CALLS = {torch.ops.xaccel.mlstm.default: run,
                torch.ops.xaccel.mlstm_saving.default: run_saving,
                torch.ops.xaccel.mlstm_backward.default: run_backward,
                torch.ops.xaccel.mlstm_step.default: run_step}
