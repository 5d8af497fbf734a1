"""Registration of xaccel::gemm_epilogue: schema, fake, autograd; its semantics are reference.py's."""
from __future__ import annotations

import torch
from torch import Tensor

from ... import runtime
from .. import checks
from ..checks import ANY
from . import reference
from .epilogue_ir import parse, read_by_vjp

OP_NAME = "gemm_epilogue"


def case_key(a: Tensor, bs: list[Tensor], operands: list[Tensor], epilogue: str, b_transposed: bool) -> tuple:
    """Names one case for the runtime (a cheap tuple: it is built on every call)."""
    return (a.device.type, a.dtype, b_transposed, a.shape, *(b.shape for b in bs), *(t.shape for t in operands),
            epilogue)


def run(a: Tensor, bs: list[Tensor], operands: list[Tensor], epilogue: str, b_transposed: bool) -> list[Tensor]:
    """The op's body: a registered kernel if one takes the case, else the reference. Compiled
    forward graphs call this directly (see ops.DIRECT_CALLS), skipping the dispatcher. An empty
    GEMM (M, N or K of 0) runs the reference, which returns at once."""
    args = (a, bs, operands, epilogue, b_transposed)
    if a.numel() == 0 or bs[0].numel() == 0:
        return reference.forward(*args)
    return runtime.dispatch(OP_NAME, case_key, reference.forward, *args)


def _validate(a, bs, operands, epilogue: str, b_transposed: bool) -> None:
    """a [..., M, K] and each b [K, N] ([N, K] with b_transposed; [batch, ., .] with a 3-D a) of
    one floating dtype, as many as the epilogue's accumulators; each operand the epilogue loads
    shaped as its broadcast kind against the output [..., M, N] (_validate_operand)."""
    op = OP_NAME
    ep = parse(epilogue)
    checks.expect_rank(op, "a", a, "[..., M, K]", 2)
    checks.expect_float(op, "a", a)
    accs = 1 + max((n["index"] for n in ep.nodes if n["op"] == "acc"), default=0)
    if len(bs) != accs:
        checks.fail(op, f"bs must hold one weight per accumulator the epilogue reads ({accs}), got {len(bs)}")
    batched = a.dim() == 3 and bs[0].dim() == 3
    layout = f"[{'batch, ' if batched else ''}{'N, K' if b_transposed else 'K, N'}]"
    checks.expect_shape(op, "bs[0]", bs[0], layout, (ANY,) * (3 if batched else 2))
    lead, K, N = (a.shape[0],) if batched else (), a.shape[-1], bs[0].shape[-2 if b_transposed else -1]
    for j, b in enumerate(bs):
        checks.expect_shape(op, f"bs[{j}]", b, layout, (*lead, N, K) if b_transposed else (*lead, K, N))
        checks.expect_dtype(op, f"bs[{j}]", b, a.dtype, "a")
    out = (*a.shape[:-1], N)
    for node in ep.nodes:
        if node["op"] == "load":
            _validate_operand(operands, node["operand"], node["bcast"], out, a.dtype)


def _validate_operand(operands, j: int, bcast: str, out: tuple, dtype) -> None:
    """Operand j as the epilogue reads it: a scalar (all sizes 1, any floating dtype), or in the
    output's dtype a full tensor (the output's shape), a row ([1, ..., 1, N]) or a column
    ([..., M, 1])."""
    op, name = OP_NAME, f"operands[{j}]"
    if j >= len(operands):
        checks.fail(op, f"operands must hold operand {j}, which the epilogue loads; got {len(operands)} operands")
    t = operands[j]
    checks.expect_float(op, name, t)
    if bcast == "scalar":
        checks.expect_shape(op, name, t, "a scalar (every size 1)", (1,) * t.dim())
        return
    checks.expect_dtype(op, name, t, dtype, "the output")
    if bcast == "full":
        checks.expect_shape(op, name, t, "a full operand (the output's shape)", out)
    elif bcast == "col":
        checks.expect_shape(op, name, t, "a column [..., M, 1]", (*out[:-1], 1))
    else:
        checks.expect_rank(op, name, t, "a row [1, ..., 1, N]", 1)
        checks.expect_shape(op, name, t, "a row [1, ..., 1, N] within the output's rank",
                            (1,) * (min(t.dim(), len(out)) - 1) + out[-1:])


@torch.library.custom_op("xaccel::gemm_epilogue", mutates_args=())
def gemm_epilogue(a: Tensor, bs: list[Tensor], operands: list[Tensor], epilogue: str,
                  b_transposed: bool) -> list[Tensor]:
    _validate(a, bs, operands, epilogue, b_transposed)
    return run(a, bs, operands, epilogue, b_transposed)


@gemm_epilogue.register_fake
def _fake(a, bs, operands, epilogue, b_transposed):
    _validate(a, bs, operands, epilogue, b_transposed)
    shape = torch.matmul(a, reference.b_kn(bs[0], b_transposed)).shape
    n_out = len(parse(epilogue).outputs)
    return [a.new_empty(shape) for _ in range(n_out)]


def _saved_positions(epilogue: str) -> dict[int, int]:
    """node id -> output position, for the outputs whose values the reverse pass reads."""
    ep = parse(epilogue)
    reads = read_by_vjp(ep)
    return {o: k for k, o in enumerate(ep.outputs) if o in reads}


def _constant_outputs(epilogue: str, a, bs, operands) -> list[int]:
    """Positions of the outputs that depend on no input requiring grad: eager gives such a value
    requires_grad=False, though the op's other outputs may need gradients."""
    ep = parse(epilogue)
    grad_accs = {i for i, b in enumerate(bs) if a.requires_grad or b.requires_grad}
    grad_ops = {j for j, t in enumerate(operands) if t.requires_grad}
    needs = []
    for i, n in enumerate(ep.nodes):
        if n["op"] == "acc":
            needs.append(n["index"] in grad_accs)
        elif n["op"] == "load":
            needs.append(n["operand"] in grad_ops)
        else:
            needs.append(any(needs[j] for j in n.get("in", ())))
    return [k for k, o in enumerate(ep.outputs) if not needs[o]]


def _setup_context(ctx, inputs, output):
    a, bs, operands, epilogue, b_transposed = inputs
    constant = _constant_outputs(epilogue, a, bs, operands)
    if constant:
        ctx.mark_non_differentiable(*(output[k] for k in constant))
    pos = _saved_positions(epilogue)
    ctx.save_for_backward(a, *bs, *operands, *(output[k] for k in pos.values()))
    ctx.saved_nodes = list(pos)
    ctx.set_materialize_grads(False)  # outputs the graph never reads (saved values) get None, not zeros
    ctx.n_b, ctx.n_ops = len(bs), len(operands)
    ctx.epilogue, ctx.b_transposed = epilogue, b_transposed


def _backward(ctx, grads):
    t = ctx.saved_tensors
    nb, no = ctx.n_b, ctx.n_ops
    a, bs, operands, kept = t[0], list(t[1:1 + nb]), list(t[1 + nb:1 + nb + no]), t[1 + nb + no:]
    da, dbs, dops = reference.backward(list(grads), a, bs, operands, ctx.epilogue, ctx.b_transposed,
                                       dict(zip(ctx.saved_nodes, kept)))
    return da, dbs, dops, None, None


gemm_epilogue.register_autograd(_backward, setup_context=_setup_context)

# called directly by compiled forward graphs (ops.DIRECT_CALLS), past the dispatcher
DIRECT_CALLS = {torch.ops.xaccel.gemm_epilogue.default: run}
