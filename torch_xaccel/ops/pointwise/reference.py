"""xaccel::pointwise's semantics: the group's ops evaluated in fp32 on its inputs (broadcast by
torch's rules), each output rounded once to the group's dtype and laid out with its strides. In
fp32 this is eager's result (up to the order of fused multiply-adds); in bf16 and fp16 eager
rounds after every op, the group once, at the end."""
from __future__ import annotations

import torch

from ..gemm_epilogue.epilogue_ir import evaluate
from .program import Program


def forward(inputs: list[torch.Tensor], program: Program) -> list[torch.Tensor]:
    vals = evaluate(program.ir, (), inputs, dtype=torch.float32, only=_needed(program))
    outs = []
    for o, strides in zip(program.outputs, program.strides):
        out = torch.empty_strided(program.shape, strides, dtype=program.torch_dtype, device=_device(inputs))
        out.copy_(torch.broadcast_to(torch.as_tensor(vals[o]), program.shape))
        outs.append(out)
    return outs


def _device(inputs) -> torch.device:
    return inputs[0].device if inputs else torch.device("cpu")


def _needed(program: Program) -> set[int]:
    """The nodes the outputs depend on (all of them, in a group the pass built)."""
    need, todo = set(program.outputs), list(program.outputs)
    while todo:
        for j in program.nodes[todo.pop()].get("in", ()):
            if j not in need:
                need.add(j)
                todo.append(j)
    return need
