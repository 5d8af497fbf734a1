"""Registration of xaccel::pointwise (schema, fake); its semantics are reference.py's.

The op only appears in graphs that already run without autograd (aot_autograd's partitioned
forward and backward graphs, inference graphs): lowering/pointwise fuses the rest of what xaccel
runs eagerly. So it has no autograd formula of its own."""
from __future__ import annotations

import torch
from torch import Tensor

from ... import runtime
from . import reference
from .program import parse

OP_NAME = "pointwise"


def case_key(inputs, program: str) -> tuple:
    return (program, tuple((t.device.type, t.dtype, t.shape, t.stride()) for t in inputs))


def run(inputs: list[Tensor], program: str) -> list[Tensor]:
    """The op's body. Compiled graphs call it directly (ops.DIRECT_CALLS)."""
    return runtime.dispatch(OP_NAME, case_key, lambda xs, p: reference.forward(xs, parse(p)), inputs, program)


@torch.library.custom_op("xaccel::pointwise", mutates_args=())
def pointwise(inputs: list[Tensor], program: str) -> list[Tensor]:
    """inputs (each broadcastable to the program's shape) -> the program's outputs, each of its
    shape, dtype and strides."""
    return run(inputs, program)


@pointwise.register_fake
def _fake(inputs, program):
    p = parse(program)
    device = inputs[0].device if inputs else torch.device("cpu")
    return [torch.empty_strided(p.shape, s, dtype=p.torch_dtype, device=device) for s in p.strides]


# called directly by compiled graphs (ops.DIRECT_CALLS), past the dispatcher
DIRECT_CALLS = {torch.ops.xaccel.pointwise.default: run}
