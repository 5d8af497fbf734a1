"""Backend-neutral description of the elementwise chain fused into a GEMM's epilogue.

An epilogue is a small SSA program over the fp32 accumulator tile. The same node list is read by
every consumer: the plain-torch reference (`evaluate`, `vjp`), the Triton and CUTLASS (EVT)
renderers, and the ONNX exporter. It travels inside the op's arguments as canonical JSON, so a
graph, a cache key and an ONNX attribute all carry the identical string.

Node kinds (each a dict with "op"):
  acc    {"index": i}                 accumulator of GEMM i (a @ b_i, before any epilogue)
  load   {"operand": j, "bcast": b}   extra tensor operand j, lined up with the M x N output as
                                      full (same shape), row (one value per column n, e.g. a bias),
                                      col (one value per row m) or scalar (a 0-d tensor)
  const  {"value": v}                 a Python number
  unary  {"in": [x]}                  relu, gelu, gelu_tanh, silu, sigmoid, tanh
  binary {"in": [x, y]}               add, sub, mul, div
  grad   {"in": [g, x]}               gelu_grad, gelu_tanh_grad, silu_grad (x: the activation's
                                      input), sigmoid_grad, tanh_grad (x: its output), relu_grad
                                      (x: input or output): g times the activation's derivative, as
                                      ATen's *_backward ops; they appear in backward graphs, where
                                      a GEMM's result is the incoming gradient, and have no vjp
"outputs" lists the node ids the op returns: the chain's final value first, then intermediates
the rest of the graph also reads.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Sequence

import torch

from .elementwise import BINARY, BY_NAME, GRAD, UNARY

BCASTS = ("full", "row", "col", "scalar")


@dataclass(frozen=True)
class Epilogue:
    nodes: tuple[dict, ...]
    outputs: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"v": 1, "nodes": list(self.nodes), "outputs": list(self.outputs)},
                          sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "Epilogue":
        data = json.loads(text)
        if data.get("v") != 1:
            raise ValueError(f"unknown epilogue IR version {data.get('v')!r}")
        ep = Epilogue(tuple(data["nodes"]), tuple(data["outputs"]))
        ep.validate()
        return ep

    @property
    def num_accs(self) -> int:
        return 1 + max(n["index"] for n in self.nodes if n["op"] == "acc")

    def broadcasts(self) -> dict[int, str]:
        """operand index -> how the chain reads it (full, row, col or scalar)."""
        return {n["operand"]: n["bcast"] for n in self.nodes if n["op"] == "load"}

    def validate(self) -> None:
        for i, n in enumerate(self.nodes):
            op = n["op"]
            if op in UNARY or op in BINARY or op in GRAD:
                want = 1 if op in UNARY else 2
                if len(n["in"]) != want or any(not 0 <= j < i for j in n["in"]):
                    raise ValueError(f"epilogue node {i} ({op}) has bad inputs {n['in']}")
            elif op == "load" and n["bcast"] not in BCASTS:
                raise ValueError(f"epilogue node {i} has unknown broadcast {n['bcast']!r}")
            elif op not in ("acc", "load", "const"):
                raise ValueError(f"epilogue node {i} has unknown op {op!r}")
        if not self.outputs or any(not 0 <= o < len(self.nodes) for o in self.outputs):
            raise ValueError(f"epilogue outputs {self.outputs} out of range")

    def describe(self) -> str:
        """One line for reports: the ops in order, e.g. 'bias(row) -> gelu_tanh -> add(full)'."""
        parts = []
        for n in self.nodes:
            op = n["op"]
            if op in UNARY:
                parts.append(op)
            elif op in BINARY or op in GRAD:
                srcs = [self.nodes[j] for j in n["in"]]
                extra = [f"{s['value']:g}" if s["op"] == "const" else s["bcast"]
                         for s in srcs if s["op"] in ("const", "load")]
                parts.append(f"{op}({', '.join(extra)})" if extra else op)
        return " -> ".join(parts) or "(none)"


@functools.lru_cache(maxsize=512)
def parse(text: str) -> Epilogue:
    """Cached from_json: ops parse their IR string on every call."""
    return Epilogue.from_json(text)


# ---- reference semantics: fp32 evaluation of the chain ------------------------------------------

def node_function(op: str):
    """The torch function that evaluates a unary, gradient or binary IR node (as evaluate does)."""
    return BY_NAME[op].torch


def _read_directly(ep: Epilogue) -> set[int]:
    """Nodes whose values the reverse pass reads: inputs of gelu/silu, outputs of
    relu/sigmoid/tanh, factors of mul/div."""
    need: set[int] = set()
    for i, n in enumerate(ep.nodes):
        reads = BY_NAME[n["op"]].grad_reads if n["op"] in BY_NAME else None
        if reads == "input":
            need.add(n["in"][0])
        elif reads == "output":
            need.add(i)
        elif reads == "inputs":
            need.update(n["in"])
    return need


def read_by_vjp(ep: Epilogue) -> set[int]:
    """Tensor nodes the reverse pass reads directly (no loads or constants): training saves these
    from the forward."""
    return {i for i in _read_directly(ep) if ep.nodes[i]["op"] not in ("load", "const")}


def needed_by_vjp(ep: Epilogue, have: set[int] = frozenset()) -> set[int]:
    """Nodes the reverse pass must evaluate: what it reads (operands and constants included) and
    everything those are computed from, except values already at hand (`have`)."""
    need = _read_directly(ep)
    need -= set(have)
    todo = list(need)
    while todo:
        n = ep.nodes[todo.pop()]
        for j in n.get("in", ()):
            if j not in need and j not in have:
                need.add(j)
                todo.append(j)
    return need


def evaluate(ep: Epilogue, accs: Sequence[torch.Tensor], operands: Sequence[torch.Tensor],
             dtype: torch.dtype | None = torch.float32, only: set[int] | None = None,
             preset: dict[int, torch.Tensor] | None = None) -> list:
    """Value of every node (or of the nodes in `only` and `preset`; others are None), computed in
    `dtype` (fp32 is the op's semantics; tests use float64), or with dtype None in the inputs' own
    dtypes under torch's promotion rules, as eager runs the chain. `preset` supplies values
    already known (saved by the forward). Constants stay Python numbers."""
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))  # noqa: E731
    vals: list = []
    preset = preset or {}
    for i, n in enumerate(ep.nodes):
        op = n["op"]
        if i in preset:
            vals.append(cast(preset[i]))
        elif only is not None and i not in only:
            vals.append(None)
        elif op == "acc":
            vals.append(cast(accs[n["index"]]))
        elif op == "load":
            vals.append(cast(operands[n["operand"]]))
        elif op == "const":
            vals.append(n["value"])
        else:
            vals.append(BY_NAME[op].torch(*(vals[j] for j in n["in"])))
    return vals


def _unary_grad(op: str, g, x, y):
    """g times the derivative of unary `op` at input x (output y), by its grad op's formula."""
    entry = BY_NAME[op]
    return BY_NAME[entry.grad].torch(g, x if entry.grad_reads == "input" else y)


def vjp(ep: Epilogue, vals: list, out_grads: Sequence[torch.Tensor | None], dtype: torch.dtype):
    """Reverse pass over the node list: gradients of the accumulators and of the operands, in
    `dtype` (the dtype `vals` were evaluated in; only needed_by_vjp(ep) must be present).

    Uses ATen's own backward formulas, so the result matches eager autograd on the same chain.
    """
    grads: list = [None] * len(ep.nodes)

    def push(j, g):
        if ep.nodes[j]["op"] != "const":
            grads[j] = g if grads[j] is None else grads[j] + g

    for o, g in zip(ep.outputs, out_grads):
        if g is not None:
            push(o, g.to(dtype))
    acc_grads: dict[int, torch.Tensor] = {}
    op_grads: dict[int, torch.Tensor] = {}
    for i in range(len(ep.nodes) - 1, -1, -1):
        n, g = ep.nodes[i], grads[i]
        if g is None:
            continue
        op = n["op"]
        if op == "acc":
            k = n["index"]
            acc_grads[k] = g if k not in acc_grads else acc_grads[k] + g
        elif op == "load":
            k = n["operand"]
            op_grads[k] = g if k not in op_grads else op_grads[k] + g
        elif op in UNARY:
            j = n["in"][0]
            push(j, _unary_grad(op, g, vals[j], vals[i]))
        elif op in GRAD:
            raise NotImplementedError(f"{op}: second derivatives are not modelled (lowering keeps grad ops out of "
                                      "graphs that train)")
        else:
            a, b = n["in"]
            da, db = BY_NAME[op].vjp(g, vals[a], vals[b])
            push(a, da)
            push(b, db)
    return acc_grads, op_grads
