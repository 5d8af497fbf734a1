"""What the lowered graph hands Inductor, so that its caches work for xaccel graphs and stay right.

- Hits across processes: make_fx leaves its ShapeEnv on the GraphModule (`gm.shape_env`) and the
  passes read the real example inputs from `gm.meta`; AOTAutograd's cache pickles both into its
  key, and a ShapeEnv is new in every process, so no other process would ever hit. Dropped before
  Inductor runs.
- No stale hits: the graph calls torch.ops.xaccel.* by name, so a cached graph would keep the
  output shapes and strides that an older version of those ops' fake functions promised. A no-op
  post-grad pass whose uuid is the digest of torch_xaccel/ops/ puts them into Inductor's keys.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

try:  # (imported with the Inductor rest only)
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # a torch without custom-pass uuids: no ops key (the ShapeEnv fix still applies)
    CustomGraphPass = None


@functools.lru_cache(maxsize=None)
def ops_digest() -> str:
    """sha256 of the op modules' sources (schemas, fake functions, autograd formulas)."""
    h = hashlib.sha256()
    root = Path(__file__).parent / "ops"
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


if CustomGraphPass is not None:
    class XaccelOpsKey(CustomGraphPass):
        """Changes nothing; its uuid keys Inductor's caches by the xaccel ops' definitions."""

        def __init__(self, how: str = ""):
            self.how = how

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return "xaccel-ops-" + ops_digest() + self.how


def prepare(gm: torch.fx.GraphModule, patches: dict, how: str = "") -> dict:
    """Drop the per-process ShapeEnv and the example inputs from the lowered graph; return the
    config patches with the ops-digest pass added, unless the user set that pass slot already.
    `how`: settings outside Inductor's cache key that the build depends on (functorch's donated
    buffers are not in it: a graph built with them would be reused without them)."""
    from torch._inductor import config as inductor_config

    gm.__dict__.pop("shape_env", None)
    gm.meta.pop("xaccel_example_inputs", None)
    slot = "post_grad_custom_pre_pass"
    if CustomGraphPass is None or slot in patches or getattr(inductor_config, slot, None) is not None:
        return patches
    return {**patches, slot: XaccelOpsKey(how)}
