"""Backward graphs: GEMM + elementwise chains in aot_autograd's backward, fused like forward ones.

A training step's backward multiplies each incoming gradient by weights (cuBLAS) and then applies
the activation's gradient elementwise: gelu_backward(g @ W, pre) reads the GEMM's [M, hidden]
result back from memory only to write it again. Fused into the GEMM's epilogue (the gradient ops
of epilogue_ir: gelu_grad, silu_grad, ...), that round trip goes, and so does the separate add of a
residual branch's gradient to the GEMM that produces the input's gradient. The weight-gradient
GEMMs have nothing to fuse and stay on cuBLAS.

Two forms the backward trace leaves behind are folded first, or the chains would hide behind them:
a transpose of a transpose (an nn.Linear weight's backward), and torch.matmul's flattening of
leading dims (view -> mm -> _unsafe_view back to [..., N]), which becomes one aten.matmul again.
Runs at the first backward call (aot_autograd compiles backward graphs lazily); its replacements
join the forward graph's report, noted "backward".
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx

from torch_xaccel.config import Config
from torch_xaccel.report import GraphReport

from .. import PassContext
from ..graph_utils import val
from . import chains
from .chains import transposed_source

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def fold_double_transposes(gm: torch.fx.GraphModule) -> int:
    """t(t(x)) -> x, for the transposes the GEMM pass knows (last two dims)."""
    folded = 0
    for node in list(gm.graph.nodes):
        inner = transposed_source(node) if node.op == "call_function" else None
        src = transposed_source(inner) if isinstance(inner, torch.fx.Node) and inner.op == "call_function" else None
        if src is not None:
            node.replace_all_uses_with(src)
            gm.graph.erase_node(node)
            if not inner.users:
                gm.graph.erase_node(inner)
            folded += 1
    return folded


def _static_shape(shape) -> tuple[int, ...] | None:
    return tuple(shape) if all(isinstance(s, int) for s in shape) else None


def fold_flattened_matmuls(gm: torch.fx.GraphModule) -> int:
    """_unsafe_view(mm(view(x, [M, K]), b), [*lead, N]) -> matmul(x, b), where x is [*lead, K]
    with M = prod(lead): what torch.matmul on a batched input decomposes to. Static shapes only."""
    folded = 0
    for mm in list(gm.graph.find_nodes(op="call_function", target=aten.mm.default)):
        flat, b = mm.args[0], mm.args[1]
        if len(mm.users) != 1 or not isinstance(flat, torch.fx.Node) or flat.target not in _VIEWS:
            continue
        (back,) = mm.users
        x = flat.args[0]
        vx, vflat, vback = val(x), val(flat), val(back)
        if back.target not in _VIEWS or not all(isinstance(v, torch.Tensor) for v in (vx, vflat, vback)):
            continue
        sx, sflat, sback = (_static_shape(v.shape) for v in (vx, vflat, vback))
        if None in (sx, sflat, sback) or len(sx) < 3:
            continue
        lead = sx[:-1]
        if sflat != (math.prod(lead), sx[-1]) or sback != (*lead, val(mm).shape[-1]):
            continue
        with gm.graph.inserting_before(back):
            matmul = gm.graph.call_function(aten.matmul.default, (x, b))
        matmul.meta.update({k: v for k, v in back.meta.items() if k in ("val", "stack_trace")})
        back.replace_all_uses_with(matmul)
        gm.graph.erase_node(back)
        gm.graph.erase_node(mm)
        if not flat.users:
            gm.graph.erase_node(flat)
        folded += 1
    return folded


def backward_pass(cfg: Config):
    """The backward graphs' pass for this compile (families.py), or None where it is off:
    XACCEL_BACKWARD_FUSION, or when unset, on where CUTLASS kernels run. With the Triton kernels
    alone it loses to cuBLAS on the backward's GEMMs, whose weights are read K x N (the measured
    figures are in docs/benchmarks.md)."""
    if "gemm_epilogue" not in cfg.patterns:
        return None
    enabled = cfg.backward_fusion
    if enabled is None:
        from torch_xaccel.codegen.gemm_epilogue import cutlass_kernels

        enabled = cfg.cutlass != "0" and cutlass_kernels.available()
    return (lambda gm, report: run(gm, report, cfg)) if enabled else None


def run(gm: torch.fx.GraphModule, report: GraphReport, cfg: Config) -> torch.fx.GraphModule:
    """Fuse the backward graph's GEMM chains; entries join `report` (the forward graph's) marked
    as backward. The graph computes the same values; only the rounding of fused chains changes
    (one rounding from fp32 instead of one per op, as in the forward)."""
    fold_double_transposes(gm)
    fold_flattened_matmuls(gm)
    scratch = GraphReport(index=report.index)
    chains.run(gm, PassContext(cfg, scratch, training=False), backward=True)
    report.replacements += [dataclasses.replace(r, note="; ".join(filter(None, ("backward", r.note))))
                            for r in scratch.replacements]
    report.fallbacks += [dataclasses.replace(f, reason=f"backward: {f.reason}") for f in scratch.fallbacks]
    gm.graph.lint()
    gm.recompile()
    return gm
