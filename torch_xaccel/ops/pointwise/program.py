"""What one xaccel::pointwise call computes: a group of elementwise ops over tensors of one shape,
as the gemm_epilogue family's IR (ops/gemm_epilogue/epilogue_ir.py: the elementwise table's ops,
`load` nodes for the inputs, `const` nodes for numbers; no GEMM accumulators), plus what the
outputs look like: their shape, dtype and strides (each output's strides as the graph had them,
so that views and strided ops downstream see the layout they were traced with).

A `load` reads input j broadcast to the group's shape by torch's rules (its `bcast` is "full":
broadcasting goes through the input's strides, a broadcast dim has stride 0). The program travels
inside the op's arguments as canonical JSON, so the graph and a cache key hold the same string.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

from ..gemm_epilogue.epilogue_ir import Epilogue

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Program:
    nodes: tuple[dict, ...]
    outputs: tuple[int, ...]
    shape: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]  # one per output
    dtype: str  # every output's

    @property
    def ir(self) -> Epilogue:
        return Epilogue(self.nodes, self.outputs)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def n_inputs(self) -> int:
        return 1 + max((n["operand"] for n in self.nodes if n["op"] == "load"), default=-1)

    def to_json(self) -> str:
        return json.dumps({"v": 1, "nodes": list(self.nodes), "outputs": list(self.outputs), "shape": list(self.shape),
                           "strides": [list(s) for s in self.strides], "dtype": self.dtype},
                          sort_keys=True, separators=(",", ":"))

    def describe(self) -> str:
        """One line for reports: the ops in order, e.g. 'mul -> add -> silu -> mul'."""
        return " -> ".join(n["op"] for n in self.nodes if n["op"] not in ("load", "const"))

    def validate(self) -> None:
        self.ir.validate()
        if any(n["op"] == "acc" for n in self.nodes):
            raise ValueError("a pointwise program has no GEMM accumulators")
        if len(self.strides) != len(self.outputs) or any(len(s) != len(self.shape) for s in self.strides):
            raise ValueError(f"output strides {self.strides} do not match {len(self.outputs)} outputs of {self.shape}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")


@functools.lru_cache(maxsize=1024)
def parse(text: str) -> Program:
    """The program a JSON string holds (cached: every call of the op parses its argument)."""
    data = json.loads(text)
    if data.get("v") != 1:
        raise ValueError(f"unknown pointwise program version {data.get('v')!r}")
    program = Program(tuple(data["nodes"]), tuple(data["outputs"]), tuple(data["shape"]),
                      tuple(tuple(s) for s in data["strides"]), data["dtype"])
    program.validate()
    return program
