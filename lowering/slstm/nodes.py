"""The ATen vocabulary the sLSTM matchers read, and what they ask of a node: its op, its fake value,
its shape at the example sizes, whether it is a zero tensor built in the graph."""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from ..graph_utils import is_op, val  # noqa: F401 - the family's modules import them from here

aten = torch.ops.aten

MAX = (aten.maximum.default, aten.max.other)
MIN = (aten.minimum.default, aten.min.other)
CASTS = (aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout)
# ops that take entries of one tensor as they are (views, copies, casts, tiling): a step's roots
# are taken up through them, and h passes through them linearly
VIEWS = tuple(op for op in (
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, getattr(aten.squeeze, "dims", None),
    aten.squeeze.default, aten.select.int, aten.slice.Tensor, aten.narrow.default, aten.expand.default,
    aten.repeat.default, getattr(aten, "repeat_interleave", None) and aten.repeat_interleave.self_int,
    aten.alias.default, aten.unflatten.int, aten.flatten.using_ints, aten.movedim.int, aten.clone.default,
    getattr(aten, "contiguous", None) and aten.contiguous.default,
    aten.detach.default, aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    operator.getitem, *CASTS) if op is not None)
LINEAR = VIEWS + (aten.matmul.default, aten.mm.default, aten.bmm.default, aten.einsum.default, aten.linear.default,
                  aten.addmm.default, aten.baddbmm.default, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor,
                  aten.div.Tensor, aten.neg.default, aten.stack.default, aten.cat.default)
# where a time index may appear: (op, position among its flattened arguments)
TIME_ARGS = {aten.select.int: (2,), aten.slice.Tensor: (2, 3), aten.narrow.default: (2,), operator.getitem: (1,)}
ZERO_FACTORIES = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)
FILL_FACTORIES = (aten.full.default, aten.full_like.default, aten.new_full.default)
FACTORIES = ZERO_FACTORIES + FILL_FACTORIES + (
    aten.ones.default, aten.ones_like.default, aten.new_ones.default, aten.scalar_tensor.default,
    aten.empty_like.default)


def is_zeros(node) -> bool:
    """A tensor of zeros built in the graph (through copies and views): a zero start state."""
    while is_op(node, *VIEWS) and node.target is not operator.getitem:
        node = node.args[0]
    if is_op(node, *ZERO_FACTORIES):
        return True
    return is_op(node, *FILL_FACTORIES) and node.args[-1] == 0


def static_shape(node) -> tuple | None:
    """The node's shape when every size is a plain int (dynamic sizes: None)."""
    v = val(node)
    if not isinstance(v, torch.Tensor) or not all(isinstance(s, int) for s in v.shape):
        return None
    return tuple(v.shape)


def size_hint(size) -> int | None:
    """A size as an int: its value, or a symbolic size's example value (None: unbacked)."""
    return size if isinstance(size, int) else getattr(size.node, "hint", None)


def example_shape(node) -> tuple | None:
    """The node's shape at the example sizes the graph was traced with (symbolic sizes as their
    example values): the sizes the layouts are measured and proven at."""
    v = val(node)
    if not isinstance(v, torch.Tensor):
        return None
    hints = tuple(size_hint(s) for s in v.shape)
    return None if None in hints else hints


def is_size(node) -> bool:
    """A node computing a symbolic size (x.shape[0] under dynamic shapes): an integer the step
    reads for its views, not a tensor root; measuring and proving run it at its example value."""
    return isinstance(node, Node) and isinstance(val(node), torch.SymInt)
