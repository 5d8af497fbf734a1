"""Graph passes: normalize a Dynamo graph to ATen, then match each family and rewrite it to
torch.ops.xaccel.* calls. Installed as torch_xaccel.lowering."""
from __future__ import annotations

from typing import Callable

import dataclasses

import torch
import torch.fx

from . import gemm_epilogue, mlstm, mlstm_step

# family -> pass(gm, graph_report, training); order matters: larger patterns first once there are several.
PASSES: dict[str, Callable[[torch.fx.GraphModule, object, bool], None]] = {
    # mLSTM passes first (their regions hold matmuls the GEMM pass would otherwise take); the step
    # before the sequence form, so that steps it replaces are not reported as unrecognized mLSTMs
    "mlstm_step": mlstm_step.run,
    "mlstm": mlstm.run,
    "gemm_epilogue": gemm_epilogue.run,
}
FAMILIES_WITH_PASSES: tuple[str, ...] = tuple(PASSES)


def run_passes(gm: torch.fx.GraphModule, patterns, graph_report, training: bool = False,
               keep_mlstm_states: bool = True) -> torch.fx.GraphModule:
    """training: some graph input requires grad under grad mode (the pre-dispatch graph's fake
    values do not carry requires_grad, so the backend decides this from the real inputs).
    keep_mlstm_states (XACCEL_MLSTM_KEEP_STATES): a training graph's mLSTMs keep their chunk
    states for the backward."""
    for family, fn in PASSES.items():
        if family in patterns:
            fn(gm, graph_report, training)
    if training and keep_mlstm_states and keep_mlstm_chunk_states(gm):
        graph_report.replacements[:] = [
            dataclasses.replace(r, note="; ".join(filter(None, (r.note, "keeps its chunk states for the backward"))))
            if r.op == "xaccel.mlstm" else r for r in graph_report.replacements]
    gm.graph.lint()
    gm.recompile()
    return gm


def keep_mlstm_chunk_states(gm: torch.fx.GraphModule) -> int:
    """In a training graph, every xaccel.mlstm whose kernels' backward would read them
    (triton_mlstm.backward_reads_kept_states: CUDA, a chunk size and head shape whose backward
    configs all walk that chunk) becomes xaccel.mlstm_with_chunk_states: the same first four
    outputs, plus the states entering each chunk, which its backward reads instead of rerunning
    the sequential scan (0.5-1 ms of a 4-8 ms forward + backward on the H200). Its users index
    outputs 0-3, so only the target and the fake value change; a node without a fake value is
    left alone. Returns how many were changed."""
    from torch_xaccel.codegen import triton_mlstm

    old, new = torch.ops.xaccel.mlstm.default, torch.ops.xaccel.mlstm_with_chunk_states.default
    changed = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=old)):
        fake = node.meta.get("val")
        fake_mode = getattr(fake[0], "fake_mode", None) if isinstance(fake, (tuple, list)) else None
        args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
        kwargs = {k: a.meta.get("val") if isinstance(a, torch.fx.Node) else a for k, a in node.kwargs.items()}
        q, v = args[0], args[2]
        chunk = args[9] if len(args) > 9 else kwargs.get("chunk_size")
        if fake_mode is None or not isinstance(q, torch.Tensor) or not isinstance(v, torch.Tensor):
            continue
        DK, DV = q.shape[-1], v.shape[-1]
        if not all(isinstance(d, int) for d in (DK, DV, chunk)) or \
                not triton_mlstm.backward_reads_kept_states(q.device.type, q.dtype, DK, DV, chunk):
            continue
        node.target = new
        with fake_mode:
            node.meta["val"] = new(*args, **kwargs)
        changed += 1
    return changed
