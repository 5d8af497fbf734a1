"""Helpers shared by the mLSTM passes' structural walks over ATen graphs."""
from __future__ import annotations

import torch
import torch.fx

DYNAMIC_EPS = ("eps is a dynamic Python float (torch.compile makes float arguments graph inputs under "
               "dynamic shapes); pass it as a constant (a module attribute, functools.partial) or set "
               "torch._dynamo.config.specialize_float = True")


class NoMatch(Exception):
    """A step of the pattern did not hold; the message says which."""


class DynamicEps(NoMatch):
    """The form holds but its eps is a graph input (DYNAMIC_EPS): a pass asks the backend for the
    graph's float inputs as constants (lowering.CONSTANT_FLOATS)."""

    def __init__(self):
        super().__init__(DYNAMIC_EPS)


def is_op(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def expect(node, *targets, what: str):
    if not is_op(node, *targets):
        name = getattr(getattr(node, "target", None), "__name__", str(node))
        raise NoMatch(f"expected {what}, found {name}")
    return node


def example_int(size) -> int | None:
    """The size's value in this compile: a constant in the user's code (a scale 1/sqrt(8)) can only be
    in the graph if Dynamo specialised that size, so comparing against its example value is sound."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def kernel_refusal(q, k, v) -> str | None:
    """Why no kernel would run an mLSTM on these values' CUDA device (None: one would, or they are
    not on CUDA, where the reference is the product's path). On a GPU, a match that only the op's
    chunkwise reference would run stays as written: replacing it would make the compiled model
    slower than the uncompiled one."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    from torch_xaccel.codegen import mlstm as kernels

    return kernels.why_not(q, k, v)
