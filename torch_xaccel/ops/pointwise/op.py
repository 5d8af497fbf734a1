"""Registration of xaccel::pointwise (schema, fake); its semantics are reference.py's.

The op only appears in graphs that already run without autograd (aot_autograd's partitioned
forward and backward graphs, inference graphs): lowering/pointwise fuses the rest of what xaccel
runs eagerly. So it has no autograd formula of its own."""
from __future__ import annotations

import torch
from torch import Tensor

from ... import runtime
from .. import checks
from . import reference
from .program import Program, parse

OP_NAME = "pointwise"


def case_key(inputs, program: str) -> tuple:
    return (program, tuple((t.device.type, t.dtype, t.shape, t.stride()) for t in inputs))


def run(inputs: list[Tensor], program: str) -> list[Tensor]:
    """The op's body. Compiled graphs call it directly (ops.DIRECT_CALLS). An empty shape runs the
    reference, which returns at once."""
    p = parse(program)
    if 0 in p.shape:
        return reference.forward(inputs, p)
    return runtime.dispatch(OP_NAME, case_key, lambda xs, p: reference.forward(xs, parse(p)), inputs, program)


def _validate(inputs, p: Program) -> None:
    """As many inputs as the program loads, each floating and broadcastable to its shape (and of
    its dtype, but for a 0-d input); each output's strides free of overlaps (a write would lose
    values)."""
    if len(inputs) != p.n_inputs:
        checks.fail(OP_NAME, f"inputs must hold the {p.n_inputs} tensors the program loads, got {len(inputs)}")
    for j, t in enumerate(inputs):
        name = f"inputs[{j}]"
        checks.expect_float(OP_NAME, name, t)
        if t.dim():
            checks.expect_dtype(OP_NAME, name, t, p.torch_dtype, "the program")
        pairs = zip(reversed(t.shape), reversed(p.shape))
        if t.dim() > len(p.shape) or any(checks.differs(s, 1) and checks.differs(s, w) for s, w in pairs):
            checks.fail(OP_NAME, f"{name} must broadcast to the program's shape {list(p.shape)}, got {list(t.shape)}")
    for k, strides in enumerate(p.strides):
        if checks.may_overlap(p.shape, strides):
            checks.fail(OP_NAME, f"program's output {k} strides {list(strides)} overlap over its shape {list(p.shape)}")


@torch.library.custom_op("xaccel::pointwise", mutates_args=())
def pointwise(inputs: list[Tensor], program: str) -> list[Tensor]:
    """inputs (each broadcastable to the program's shape) -> the program's outputs, each of its
    shape, dtype and strides."""
    _validate(inputs, parse(program))
    return run(inputs, program)


@pointwise.register_fake
def _fake(inputs, program):
    p = parse(program)
    _validate(inputs, p)
    device = inputs[0].device if inputs else torch.device("cpu")
    return [torch.empty_strided(p.shape, s, dtype=p.torch_dtype, device=device) for s in p.strides]


# called directly by compiled graphs (ops.DIRECT_CALLS), past the dispatcher
DIRECT_CALLS = {torch.ops.xaccel.pointwise.default: run}
