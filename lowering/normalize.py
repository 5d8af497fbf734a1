"""Bring a Dynamo graph to one ATen-level IR: pre-dispatch (still differentiable), fake tensors,
symbolic shapes shared with Dynamo's shape environment. Patterns match on this IR only."""
from __future__ import annotations

import contextlib

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx


def to_aten(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """Retrace through an Interpreter so every ATen node keeps the user's stack trace in its meta
    (the report points at source lines). make_fx reuses Dynamo's fake mode when there is one."""
    def run(*args):
        return torch.fx.Interpreter(gm).run(*args)

    # Trace Dynamo's own fake values (static sizes stay static, dynamic ones keep Dynamo's symbols
    # and their sources). Real tensors would be fakeified afresh with new symbols that Dynamo
    # cannot turn into guards ("symbol_to_source" errors at guard time).
    fakes = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    args = fakes if len(fakes) == len(example_inputs) and all(f is not None for f in fakes) else example_inputs
    with fx_traceback.preserve_node_meta(), _scalar_outputs(args):
        g = make_fx(run, pre_dispatch=True, tracing_mode="symbolic")(*args)
    drop_identity_dropouts(g)
    return g


# ATen returns the input itself from these when p == 0 or train is False (_dropout_impl)
_DROPOUTS = (torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default,
             torch.ops.aten.alpha_dropout.default, torch.ops.aten.feature_alpha_dropout.default)


def drop_identity_dropouts(gm: torch.fx.GraphModule) -> int:
    """Remove the dropouts that return their input (p == 0, or not training): an nn.Dropout(0.0)
    in a training graph sits between a projection and its residual add and would hide the GEMM
    chain. Returns how many went."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _DROPOUTS:
            continue
        a = node.args
        x = a[0] if a else node.kwargs.get("input")
        p = a[1] if len(a) > 1 else node.kwargs.get("p")
        train = a[2] if len(a) > 2 else node.kwargs.get("train")
        if not isinstance(x, torch.fx.Node) or not (train is False or (isinstance(p, (int, float)) and p == 0)):
            continue
        node.replace_all_uses_with(x)
        gm.graph.erase_node(node)
        dropped += 1
    if dropped:
        gm.recompile()
    return dropped


@contextlib.contextmanager
def _scalar_outputs(args):
    """Dynamo passes an unspecialized Python float (an eps default argument under dynamic=True)
    as a 0-d tensor and calls .item() on it in the graph; tracing that on fake tensors needs the
    fake mode to allow scalar outputs (it then yields an unbacked SymFloat)."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(args)
    if mode is None or not hasattr(mode, "allow_scalar_outputs"):
        yield
        return
    before = mode.allow_scalar_outputs
    mode.allow_scalar_outputs = True
    try:
        yield
    finally:
        mode.allow_scalar_outputs = before
