"""The elementwise ops a GEMM epilogue can hold: one entry per op, read by every layer.

Each entry gives the op's torch reference (what the epilogue IR's evaluate runs), the ATen
overloads the matcher takes for it, its Triton and CUTLASS (fp32 C++) expressions and its
gradient rule; the ONNX exporter adds its expression here too. A renderer's expression is a
list: temporaries, then the value, with placeholders {x} (the input; a binary op's first),
{y} (a binary op's second), {g} (a gradient op's incoming gradient, {x} then being the
activation's input or output) and {t} (a temporary of this node).

Kinds: unary (one input), binary (two inputs), grad (g times an activation's derivative, as
ATen's *_backward ops: only backward graphs hold them, and they have no gradient of their own).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _approximate(args, kwargs, position: int) -> str:
    return kwargs.get("approximate", args[position] if len(args) > position else "none")


@dataclass(frozen=True)
class Elementwise:
    name: str
    kind: str  # "unary", "binary" or "grad"
    torch: Callable
    aten: tuple  # OpOverloads the matcher takes for this op
    triton: tuple[str, ...]
    cutlass: tuple[str, ...]
    # the ATen node's other arguments, when one overload serves two ops (gelu and gelu_tanh)
    when: Callable[[tuple, dict], bool] | None = None
    # unary: the grad op that differentiates it and whether that reads the op's "input" or
    # "output"; binary: vjp(g, x, y) -> (dx, dy) and whether the gradient reads the inputs
    grad: str | None = None
    grad_reads: str | None = None
    vjp: Callable | None = None


_GELU_ERF = "0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))"
_GELU_TANH = "0.5 * {x} * (1.0 + _tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})))"

OPS: tuple[Elementwise, ...] = (
    # ---- unary -----------------------------------------------------------------------------------
    Elementwise("relu", "unary", torch.relu, (aten.relu.default,),
                triton=("tl.maximum({x}, 0.0)",), cutlass=("fmaxf({x}, 0.f)",),
                grad="relu_grad", grad_reads="output"),
    Elementwise("gelu", "unary", lambda x: F.gelu(x), (aten.gelu.default,),
                triton=(_GELU_ERF,), cutlass=("0.5f * {x} * (1.f + erff({x} * 0.70710678118654752f))",),
                when=lambda args, kwargs: _approximate(args, kwargs, 1) != "tanh",
                grad="gelu_grad", grad_reads="input"),
    Elementwise("gelu_tanh", "unary", lambda x: F.gelu(x, approximate="tanh"), (aten.gelu.default,),
                triton=(_GELU_TANH,),
                cutlass=("0.5f * {x} * (1.f + cutlass::fast_tanh(0.79788456080286536f * "
                         "({x} + 0.044715f * {x} * {x} * {x})))",),
                when=lambda args, kwargs: _approximate(args, kwargs, 1) == "tanh",
                grad="gelu_tanh_grad", grad_reads="input"),
    Elementwise("silu", "unary", F.silu, (aten.silu.default,),
                triton=("{x} * tl.sigmoid({x})",), cutlass=("{x} / (1.f + __expf(-{x}))",),
                grad="silu_grad", grad_reads="input"),
    Elementwise("sigmoid", "unary", torch.sigmoid, (aten.sigmoid.default,),
                triton=("tl.sigmoid({x})",), cutlass=("1.f / (1.f + __expf(-{x}))",),
                grad="sigmoid_grad", grad_reads="output"),
    Elementwise("tanh", "unary", torch.tanh, (aten.tanh.default,),
                triton=("_tanh({x})",), cutlass=("cutlass::fast_tanh({x})",),
                grad="tanh_grad", grad_reads="output"),
    # ---- binary ----------------------------------------------------------------------------------
    Elementwise("add", "binary", torch.add, (aten.add.Tensor,), triton=("{x} + {y}",), cutlass=("{x} + {y}",),
                vjp=lambda g, x, y: (g, g)),
    # rsub(x, y) = y - x: the matcher swaps its arguments
    Elementwise("sub", "binary", torch.sub, (aten.sub.Tensor, aten.rsub.Scalar), triton=("{x} - {y}",),
                cutlass=("{x} - {y}",), vjp=lambda g, x, y: (g, -g)),
    Elementwise("mul", "binary", torch.mul, (aten.mul.Tensor,), triton=("{x} * {y}",), cutlass=("{x} * {y}",),
                grad_reads="inputs", vjp=lambda g, x, y: (g * y, g * x)),
    Elementwise("div", "binary", torch.div, (aten.div.Tensor,), triton=("{x} / {y}",), cutlass=("{x} / {y}",),
                grad_reads="inputs", vjp=lambda g, x, y: (g / y, -g * ((x / y) / y))),  # ATen's own order
    # ---- activation gradients: (g, x) ------------------------------------------------------------
    Elementwise("gelu_grad", "grad", lambda g, x: aten.gelu_backward(g, x), (aten.gelu_backward.default,),
                triton=("{g} * (0.5 * (1.0 + tl.erf({x} * 0.7071067811865476)) + {x} * 0.3989422804014327 * "
                        "tl.exp(-0.5 * {x} * {x}))",),
                cutlass=("{g} * (0.5f * (1.f + erff({x} * 0.70710678118654752f)) + {x} * 0.39894228040143268f * "
                         "__expf(-0.5f * {x} * {x}))",),
                when=lambda args, kwargs: _approximate(args, kwargs, 2) != "tanh"),
    Elementwise("gelu_tanh_grad", "grad", lambda g, x: aten.gelu_backward(g, x, approximate="tanh"),
                (aten.gelu_backward.default,),
                triton=("{t} = _tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x}))",
                        "{g} * (0.5 * (1.0 + {t}) + 0.5 * {x} * (1.0 - {t} * {t}) * 0.7978845608028654 * "
                        "(1.0 + 0.134145 * {x} * {x}))"),
                cutlass=("const float {t} = cutlass::fast_tanh(0.79788456080286536f * "
                         "({x} + 0.044715f * {x} * {x} * {x}))",
                         "{g} * (0.5f * (1.f + {t}) + 0.5f * {x} * (1.f - {t} * {t}) * 0.79788456080286536f * "
                         "(1.f + 0.134145f * {x} * {x}))"),
                when=lambda args, kwargs: _approximate(args, kwargs, 2) == "tanh"),
    Elementwise("silu_grad", "grad", lambda g, x: aten.silu_backward(g, x), (aten.silu_backward.default,),
                triton=("{t} = tl.sigmoid({x})", "{g} * {t} * (1.0 + {x} * (1.0 - {t}))"),
                cutlass=("const float {t} = 1.f / (1.f + __expf(-{x}))", "{g} * {t} * (1.f + {x} * (1.f - {t}))")),
    # (x: the sigmoid's / tanh's output)
    Elementwise("sigmoid_grad", "grad", lambda g, y: aten.sigmoid_backward(g, y), (aten.sigmoid_backward.default,),
                triton=("{g} * (1.0 - {x}) * {x}",), cutlass=("{g} * (1.f - {x}) * {x}",)),
    Elementwise("tanh_grad", "grad", lambda g, y: aten.tanh_backward(g, y), (aten.tanh_backward.default,),
                triton=("{g} * (1.0 - {x} * {x})",), cutlass=("{g} * (1.f - {x} * {x})",)),
    # (x: relu's input or output; the matcher takes threshold_backward with a threshold of 0 only)
    Elementwise("relu_grad", "grad", lambda g, x: aten.threshold_backward(g, x, 0),
                (aten.threshold_backward.default,),
                triton=("tl.where({x} > 0.0, {g}, 0.0)",), cutlass=("({x} > 0.f ? {g} : 0.f)",)),
)

BY_NAME: dict[str, Elementwise] = {op.name: op for op in OPS}
UNARY = tuple(op.name for op in OPS if op.kind == "unary")
BINARY = tuple(op.name for op in OPS if op.kind == "binary")
GRAD = tuple(op.name for op in OPS if op.kind == "grad")

_BY_ATEN: dict = {}
for _op in OPS:
    for _target in _op.aten:
        _BY_ATEN.setdefault(_target, []).append(_op)


def from_aten(target, args: tuple = (), kwargs: dict | None = None) -> Elementwise | None:
    """The op an ATen call computes, or None when no entry takes it."""
    for op in _BY_ATEN.get(target, ()):
        if op.when is None or op.when(args, kwargs or {}):
            return op
    return None


def takes(target) -> bool:
    """Whether some entry takes this ATen overload (before looking at its other arguments)."""
    return target in _BY_ATEN


def expression(op: str, backend: str, names: dict[str, str]) -> tuple[list[str], str]:
    """(temporaries, value) of `op` for a renderer ("triton" or "cutlass"), over the given
    placeholder names."""
    *temps, last = getattr(BY_NAME[op], backend)
    return [t.format(**names) for t in temps], last.format(**names)
