"""Registration of xaccel::gemm_epilogue: schema, fake, autograd; its semantics are reference.py's."""
from __future__ import annotations

import torch
from torch import Tensor

from ... import runtime
from . import reference
from .epilogue_ir import parse, read_by_vjp

OP_NAME = "gemm_epilogue"


def case_key(a: Tensor, bs: list[Tensor], operands: list[Tensor], epilogue: str, b_transposed: bool) -> tuple:
    """Names one case for the runtime (a cheap tuple: it is built on every call)."""
    return (a.device.type, a.dtype, b_transposed, a.shape, *(b.shape for b in bs), *(t.shape for t in operands),
            epilogue)


def run(a: Tensor, bs: list[Tensor], operands: list[Tensor], epilogue: str, b_transposed: bool) -> list[Tensor]:
    """The op's body: a registered kernel if one takes the case, else the reference. Compiled
    forward graphs call this directly (see ops.DIRECT_CALLS), skipping the dispatcher."""
    return runtime.dispatch(OP_NAME, case_key, reference.forward, a, bs, operands, epilogue, b_transposed)


@torch.library.custom_op("xaccel::gemm_epilogue", mutates_args=())
def gemm_epilogue(a: Tensor, bs: list[Tensor], operands: list[Tensor], epilogue: str,
                  b_transposed: bool) -> list[Tensor]:
    return run(a, bs, operands, epilogue, b_transposed)


@gemm_epilogue.register_fake
def _fake(a, bs, operands, epilogue, b_transposed):
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
