"""Training on many processes: DDP's graph splits, and what the report says about them.

DDP. With `torch._dynamo.config.optimize_ddp` at torch's default (True: the "DDP optimizer"),
Dynamo cuts a graph captured inside a DDP module at its gradient-bucket boundaries and calls the
backend once per piece, so that each bucket's all-reduce can start while the earlier pieces'
backward still runs. xaccel then matches each piece on its own: a region whose nodes fall on both
sides of a cut (a SwiGLU whose two GEMMs land in different buckets, two skinny gate linears of one
input, a GEMM and the epilogue after it) is matched in parts or not at all, and each rank runs
other kernels than one process does. With `optimize_ddp=False` ("no_optimization") Dynamo
hands the backend the whole graph: every region is matched as in one process, and DDP's C++
reducer all-reduces the buckets as their gradients become ready, which for one compiled graph
is at the end of its backward (no overlap of communication with the backward).

- `keep_graphs_whole()`: sets `optimize_ddp=False`; call it before the first compiled step.
- `prefer_whole_graphs()`: the same, but only where the setting is still torch's default `True`
  (a user's `False`, `"ddp_optimizer"` or `"python_reducer"` stays); the backend calls it when it
  loads, so `backend="xaccel"` under DDP keeps its graphs whole unless asked otherwise.
- `split_note(gm)`: a line for the report when the backend is compiling one of the DDP
  optimizer's pieces (the user asked for `optimize_ddp="ddp_optimizer"`, or set `True` after the
  backend loaded): which piece, where it starts, which parameters its bucket holds.

Only public settings are written (`torch._dynamo.config.optimize_ddp`); what `split_note` reads of
a piece (the reason Dynamo's DDP optimizer writes on it, its placeholders' sources, the active DDP
module's bucket size) is read defensively: where a torch version lacks it, the note says less or
nothing, and compiling never fails because of it.

FSDP2 (`torch.distributed.fsdp.fully_shard`) needs nothing here: its hooks break the graph at
each sharded unit (one graph per unit's code, reused by units of the same code), and xaccel ops
take the unsharded parameters FSDP2 gathers before each unit runs.
"""
from __future__ import annotations

import re

import torch

from .logs import log

# What Dynamo's DDP optimizer writes on each piece it hands the backend (its
# `compile_subgraph_reason`): "DDPOptimizer intentional graph-break (See Note [DDPOptimizer]) ..."
_PIECE_MARK = "DDPOptimizer"
_COUNTER = "xaccel_ddp_pieces"  # pieces of one split share one meta dict: their numbers


def _dynamo_config():
    import torch._dynamo.config as config

    return config


def keep_graphs_whole() -> object:
    """Let the backend see whole graphs under DDP: `torch._dynamo.config.optimize_ddp = False`.
    Returns the previous value. Call before the first compiled step (Dynamo reads the setting
    when it compiles a frame; a frame already compiled keeps its pieces until it recompiles)."""
    config = _dynamo_config()
    previous = config.optimize_ddp
    config.optimize_ddp = False
    return previous


def prefer_whole_graphs() -> bool:
    """`keep_graphs_whole()` where `optimize_ddp` is still torch's default (the boolean True),
    leaving any value a user chose (False, or a mode named by its string, "ddp_optimizer"
    included: the way to keep the DDP optimizer with xaccel). Returns whether it changed."""
    if _dynamo_config().optimize_ddp is not True:
        return False
    keep_graphs_whole()
    log.debug("torch._dynamo.config.optimize_ddp: True -> False (xaccel matches whole graphs under DDP; "
              "set it to \"ddp_optimizer\" to keep the DDP optimizer's bucket splits)")
    return True


def _source_fqn(node: torch.fx.Node) -> str:
    """A parameter placeholder's name as the module calls it ('blocks.0.mlp.w_up.weight'), from
    Dynamo's source ("L['self']._modules['blocks']._modules['0']..._parameters['weight']")."""
    source = getattr(node, "_dynamo_source", None)
    try:
        name = getattr(source, "name", "")  # a property (torch 2.13, 2.14), a method before
        name = str(name() if callable(name) else name or "")
    except Exception:  # noqa: BLE001 - a name only
        name = ""
    parts = re.findall(r"\[['\"]([^'\"]+)['\"]\]", name)
    return ".".join(parts[1:]) if len(parts) > 1 else node.name


def _first_location(gm: torch.fx.GraphModule) -> str:
    """'forms.py:54 in forward': the user's line of the piece's first op (the cut before it)."""
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        trace = node.meta.get("stack_trace") or ""
        found = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
        if found:
            path, line, fn = found[-1]
            return f"{path.rsplit('/', 1)[-1]}:{line} in {fn}"
    return ""


def _bucket_cap_mb() -> float | None:
    try:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel._get_active_ddp_module()
        return None if ddp is None else ddp.bucket_bytes_cap / 2**20
    except Exception:  # noqa: BLE001
        return None


def is_split_piece(gm: torch.fx.GraphModule) -> bool:
    """Whether Dynamo's DDP optimizer cut this graph out of a larger one."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return _PIECE_MARK in str(getattr(reason, "reason", "") or "")


def split_note(gm: torch.fx.GraphModule) -> str | None:
    """The report's line for a graph that is one piece of a DDP optimizer split, else None.
    Never raises."""
    try:
        if not is_split_piece(gm):
            return None
        meta = getattr(gm, "meta", None)
        number = None
        if isinstance(meta, dict):  # shared by the pieces of one split (torch 2.13, 2.14: propagate_metadata)
            seen = meta.setdefault(_COUNTER, {})  # id(piece) -> its number, in the order they compile
            number = seen.setdefault(id(gm), len(seen) + 1)
        params, size = [], 0
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                params.append(_source_fqn(node))
                size += value.numel() * value.element_size()
        cap = _bucket_cap_mb()
        where = _first_location(gm)
        setting = f"optimize_ddp={_dynamo_config().optimize_ddp!r}" + (f", bucket_cap_mb={cap:g}" if cap else "")
        held = f"{len(params)} parameter(s), {size / 2**20:.2f} MB" + (
            f": {params[0]} .. {params[-1]}" if len(params) > 1 else f": {params[0]}" if params else "")
        return (f"DDP bucket piece{f' {number}' if number else ''} ({setting}): torch's DDP optimizer cut the "
                f"captured graph at gradient-bucket boundaries; this piece{f' starts at {where},' if where else ''} "
                f"holds {held}. A region that straddles a cut is matched in parts or not at all; "
                "torch_xaccel.distributed.keep_graphs_whole() keeps the graph whole")
    except Exception:  # noqa: BLE001 - a report line never fails a compile
        return None
