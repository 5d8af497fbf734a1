"""The numeric proof both recurrent families share: is a region of the user's graph the function an
op computes?

A structural walk recognises the spellings it knows; code it does not know is run. A fixed
tolerance cannot decide that: the fp32 parallel mLSTM at S = 2048 is 4e-4 from its exact value,
while an op whose eps differs from the user's (1e-6 against none) is within 1e-5 of the user's code
on ordinary inputs and 0.5 away on others. So a candidate is judged against the user's own code run
in float64 (the truth), on inputs chosen to expose constants:
- exact: the op in float64 differs from the truth by no more than the user's own fp32 code does:
  in exact arithmetic the two are the same function, as far as fp32 can tell;
- rounded: the op in fp32 is at most FACTOR times further from the truth than the user's fp32 code
  (never worse than what the user wrote, beyond rounding noise).
Both must hold in every regime the family runs. A family assigns roles to the region's inputs from
data flow and shapes and proves each reading it cannot rule out; the readings are bounded
(MAX_CANDIDATES) and counted before any is enumerated, so a region never costs more than a bounded
number of runs of itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

FACTOR = 4.0          # the op in fp32 may be this many times further from the truth than the user's fp32 code
ROUNDED_FLOOR = 1e-6  # ... or this far (relative): a few fp32 roundings, where the user's code is near exact
EXACT_FLOOR = 1e-10   # float64 rounding: what two spellings of one function differ by in float64
MAX_CANDIDATES = 64   # readings of a region's inputs as the op's roles: more is refused, never enumerated


class NoMatch(Exception):
    """A step of a structural walk did not hold; the message says which. `depth`: how many of the
    walk's nodes held before it (the report names the furthest walk)."""

    def __init__(self, why: str = "", depth: int = 0):
        super().__init__(why)
        self.depth = depth


class Refused(Exception):
    """A region the proof does not replace; the message says why."""


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| norm-wise in float64; inf where a is not finite and b is."""
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        a = a.reshape(b.shape)
    diff = (a - b).norm()
    if not torch.isfinite(diff):
        return 0.0 if torch.equal(a.nan_to_num(), b.nan_to_num()) else float("inf")
    return (diff / b.norm().clamp_min(1e-30)).item()


@dataclass(frozen=True)
class Accuracy:
    """How far an op's result is from the truth (the user's code in float64), beside the user's own
    fp32 code's distance."""
    own: float       # the user's code in fp32
    exact: float     # the op in float64
    rounded: float   # the op in fp32

    def holds(self) -> bool:
        return (self.exact <= max(self.own, EXACT_FLOOR)
                and self.rounded <= FACTOR * max(self.own, ROUNDED_FLOOR))

    def excess(self) -> float:
        """How many times over its bound the worse of the two checks is (<= 1: it holds)."""
        return max(self.exact / max(self.own, EXACT_FLOOR), self.rounded / (FACTOR * max(self.own, ROUNDED_FLOOR)))

    def __str__(self):
        return f"{self.exact:.1e} in float64 and {self.rounded:.1e} in fp32 against the user's fp32 {self.own:.1e}"


def accuracy(truth: torch.Tensor, user32: torch.Tensor, op64: torch.Tensor, op32: torch.Tensor) -> Accuracy:
    return Accuracy(rel_error(user32, truth), rel_error(op64, truth), rel_error(op32, truth))


def worst(accuracies) -> Accuracy | None:
    """The regime farthest over its bound (None for none)."""
    return max(accuracies, key=Accuracy.excess, default=None)


# ---- running a region ------------------------------------------------------------------------------

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def in_dtype(x, dtype: torch.dtype):
    """A node's arguments with every floating dtype (a cast, a buffer's dtype) replaced by `dtype`:
    the proof checks the region's math at fp32 and at float64; its low-precision roundings only blur
    it (the ops compute in fp32 anyway)."""
    if isinstance(x, torch.dtype):
        return dtype if x in _FLOATS else x
    if isinstance(x, (tuple, list)):
        return type(x)(in_dtype(a, dtype) for a in x)
    if isinstance(x, dict):
        return {k: in_dtype(a, dtype) for k, a in x.items()}
    return x


def extract(nodes, inputs, dtype: torch.dtype | None = None, outputs=()) -> tuple[torch.fx.GraphModule, dict]:
    """The region as a GraphModule of its own: (module, {copied node's name: original node}). Its
    placeholders are `inputs` in order; it returns `outputs`' copies (nothing by default: a Recorder
    reads what it needs). With `dtype`, every floating dtype in its arguments becomes that one.
    get_attr constants are copied with the module's attribute (the owner module is the first
    node's graph's)."""
    nodes = list(nodes)
    owner = nodes[0].graph.owning_module if nodes else None
    g = torch.fx.Graph()
    root = torch.nn.Module()
    env = {x: g.placeholder(f"in{k}") for k, x in enumerate(inputs)}
    names = {}
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.op == "get_attr" and owner is not None:
            value = getattr(owner, n.target)
            setattr(root, n.target, value.to(dtype) if dtype and value.is_floating_point() else value)
        if dtype is not None:
            env[n].args, env[n].kwargs = in_dtype(env[n].args, dtype), kwargs_in_dtype(n, env[n].kwargs, dtype)
        names[env[n].name] = n
    g.output(tuple(env[o] for o in outputs) if outputs else None)
    return torch.fx.GraphModule(root, g), names


def kwargs_in_dtype(node, kwargs: dict, dtype: torch.dtype) -> dict:
    """in_dtype of a node's keyword arguments, and a factory of a floating tensor that leaves its
    dtype to the default (torch.zeros(B, D)) given `dtype` too."""
    kwargs = in_dtype(kwargs, dtype)
    schema = getattr(node.target, "_schema", None)
    value = node.meta.get("val")
    at = next((k for k, a in enumerate(schema.arguments) if a.name == "dtype"), None) if schema else None
    if at is None or at < len(node.args) or kwargs.get("dtype") is not None:
        return kwargs  # no dtype argument, or one given (positionally or by name)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        kwargs = {**kwargs, "dtype": dtype}
    return kwargs


class Recorder(torch.fx.Interpreter):
    """Runs an extracted region, keeping a copy of each floating tensor whose node `keep` names, as
    it is when computed (later in-place writes into a buffer do not change what an earlier node
    showed)."""

    def __init__(self, extracted: tuple, keep):
        gm, names = extracted
        super().__init__(gm)
        self.keep = {name: n for name, n in names.items() if keep(n)}
        self.seen: dict = {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.name in self.keep and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.seen[self.keep[n.name]] = out.detach().clone()
        return out


def record(extracted: tuple, values: list, keep) -> dict:
    """{original node: its value} for the nodes `keep` accepts, running the region on `values`."""
    rec = Recorder(extracted, keep)
    with torch.no_grad():
        rec.run(*values)
    return rec.seen
