"""Helpers shared by the mLSTM passes' structural walks over ATen graphs."""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import is_op
from ..proof import NoMatch  # the shared one; the family's walks import it from here

aten = torch.ops.aten

DYNAMIC_EPS = ("eps is a dynamic Python float (torch.compile makes float arguments graph inputs under "
               "dynamic shapes); pass it as a constant (a module attribute, functools.partial) or set "
               "torch._dynamo.config.specialize_float = True")


class DynamicEps(NoMatch):
    """The form holds but its eps is a graph input (DYNAMIC_EPS): a pass asks the backend for the
    graph's float inputs as constants (lowering.CONSTANT_FLOATS)."""

    def __init__(self):
        super().__init__(DYNAMIC_EPS)


def expect(node, *targets, what: str):
    if not is_op(node, *targets):
        name = getattr(getattr(node, "target", None), "__name__", str(node))
        raise NoMatch(f"expected {what}, found {name}")
    return node


FULL_END = 9223372036854775807  # the end of a slice written without one (x[1:])


def skip_full_slices(node, take=lambda n: n):
    """The tensor under x[..., :] style no-op slices that indexing leaves in the graph (each
    passed to `take`)."""
    while (is_op(node, aten.slice.Tensor) and len(node.args) <= 4
           and tuple(node.args[2:4]) in ((0, FULL_END), (None, None))):
        take(node)
        node = node.args[0]
    return node


def example_int(size) -> int | None:
    """The size's value in this compile's example inputs (a symbolic size's hint, without a guard):
    what a proof runs at, never what a literal in the user's code may be compared with."""
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
