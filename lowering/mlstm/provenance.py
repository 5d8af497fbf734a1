"""mLSTM code found by where it came from and proven by running it.

Chunkwise code unrolls a Python loop over chunks: hundreds of ATen nodes whose exact shape changes
with the sequence length. Instead of a structural pattern, this pass
1. takes the nodes whose stack trace runs through one function, split into connected regions
   (one per call): the functions in KNOWN (the xlstm package's native chunkwise kernel, normally
   substituted before tracing: substitutions.py), and, via run_on_functions, any
   user function holding mLSTM-like code that the structural walk in parallel.py did not match;
2. requires each region to read exactly five float tensors (3 of rank 4, 2 of rank 3) besides
   zeros() start states, and to produce exactly one tensor that the rest of the graph reads;
3. runs the region on random inputs of the real shapes (fp32) and compares it with
   xaccel::mlstm for every assignment of the inputs to (q, k, v, i, f), with the library's start
   state (C = n = 0, m = 0) or, for user functions, also without a state; exactly one assignment
   must agree within 1e-4;
4. replaces the region with that call.
A region that fails any step is reported and left as it is.
"""
from __future__ import annotations

import itertools
import operator
import os

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torch_xaccel.report import Fallback, GraphReport, Replacement

from ..graph_utils import frames, location, val
from .matching import kernel_refusal

FAMILY = "mlstm"
aten = torch.ops.aten
KNOWN = {  # (file suffix, function) -> a short name for the report
    ("mlstm_kernels/torch/chunkwise/native/fwbw.py", "mlstm_chunkwise__native_autograd"): "xlstm native chunkwise",
}
TOL = 1e-4
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
MAX_PROOF_ELEMENTS = 1 << 28  # proofs run the region at its real shapes: cap one S x S fp32 tensor at 1 GiB


def _origin(node) -> str | None:
    for path, fn in _frames(node):
        for (suffix, name), label in KNOWN.items():
            if fn == name and path.endswith(suffix):
                return label
    return None


def _frames(node) -> list[tuple[str, str]]:
    return [(path, fn) for path, _, fn in frames(node)]


def _regions(graph, origin=None) -> list[tuple[str, list]]:
    origin = origin or _origin
    members = {n: origin(n) for n in graph.nodes if n.op == "call_function"}
    members = {n: o for n, o in members.items() if o}
    parent = {n: n for n in members}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in members:
        for a in n.all_input_nodes:
            if a in members:
                parent[find(a)] = find(n)
    groups: dict = {}
    for n in graph.nodes:  # graph order inside each region
        if n in members:
            groups.setdefault(find(n), []).append(n)
    return [(members[g[0]], g) for g in groups.values()]


def _example(v, gen):
    """A random real tensor like fake value v (fp32 for floats), or v's concrete size."""
    if isinstance(v, torch.Tensor):
        shape = [int(s) for s in v.shape]
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(v.device)
    hint = getattr(getattr(v, "node", None), "hint", None)
    return int(hint) if hint is not None else v


def _extract(nodes, inputs, output):
    g = torch.fx.Graph()
    env = {x: g.placeholder(f"in{k}") for k, x in enumerate(inputs)}
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[output])
    return torch.fx.GraphModule(torch.nn.Module(), g)


_ZEROS = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)


def _verify(nodes, inputs, output, eps, kinds=("zeros",)):
    """(order, kind): the (q, k, v, i, f) order of `inputs` and the start-state kind under which
    xaccel::mlstm reproduces the region, or (None, reason). kinds: "zeros" = state (0, 0, 0) as
    the xlstm package starts; "none" = no state (the parallel form's m0 = -inf). The two agree up
    to eps effects (~1e-7 relative), so both usually fit: the closer one is taken. Inputs made
    by zeros() (the start states a wrapper passes in) stay zero: they are part of the function
    being recognised, not data."""
    from torch_xaccel.ops.mlstm import reference

    gen = torch.Generator().manual_seed(0)
    values = [torch.zeros([int(s) for s in val(x).shape], device=val(x).device) if x.target in _ZEROS
              else _example(val(x), gen) for x in inputs]
    tensors = [k for k, x in enumerate(inputs) if isinstance(val(x), torch.Tensor) and x.target not in _ZEROS]
    rank4 = [k for k in tensors if val(inputs[k]).dim() == 4]
    rank3 = [k for k in tensors if val(inputs[k]).dim() == 3]
    if len(tensors) != 5 or len(rank4) != 3 or len(rank3) != 2:
        return None, f"reads {len(tensors)} tensors, not q, k, v (4-D) and i, f (3-D)"
    B, H, S = (int(d) for d in val(inputs[rank4[0]]).shape[:3])
    if B * H * S * S > MAX_PROOF_ELEMENTS:  # the region may hold S x S intermediates
        return None, f"too large to prove by running it (B*H*S^2 = {B * H * S * S:.2e} > {MAX_PROOF_ELEMENTS:.0e})"
    for k in rank3:  # forget gates near 1 as in trained models: keeps the test well conditioned
        values[k] = values[k] + 2.0
    # Two regimes, both of which must agree: with gates as above the normalizer's row sum binds,
    # which makes h blind to a constant factor on q k^T (it cancels); with every gate shifted down
    # its floor exp(-m) binds, where h is linear in that factor and a wrong scale shows.
    regimes = [values, [t - 8.0 if k in rank3 else t for k, t in enumerate(values)]]
    region = _extract(nodes, inputs, output)
    with torch.no_grad():
        wants = [region(*vals) for vals in regimes]
        if not all(isinstance(w, torch.Tensor) for w in wants):
            return None, "the region's result is not a tensor"
        want = wants[0]
        found = []
        for (q, k, v), (i, f) in itertools.product(itertools.permutations(rank4), itertools.permutations(rank3)):
            Q, K, V = (values[x] for x in (q, k, v))
            if Q.shape != K.shape or Q.shape[:-1] != V.shape[:-1] or tuple(V.shape[:-1]) != tuple(want.shape[:-1]) \
                    or V.shape[-1] != want.shape[-1]:
                continue
            B, H, S, DK = Q.shape
            for kind in kinds:
                state = ((Q.new_zeros(B, H, DK, V.shape[-1]), Q.new_zeros(B, H, DK), Q.new_zeros(B, H))
                         if kind == "zeros" else (None, None, None))
                errs = []
                for vals, w in zip(regimes, wants):
                    got = reference.forward(*(vals[x] for x in (q, k, v, i, f)), *state, eps=eps)[0]
                    errs.append(((got - w.float()).norm() / w.float().norm().clamp_min(1e-30)).item())
                if max(errs) <= TOL:
                    found.append((max(errs), (q, k, v, i, f), kind))
    if len({order for _, order, _ in found}) != 1:
        return None, ("no assignment of its inputs to (q, k, v, i, f) reproduces it" if not found
                      else "several input assignments reproduce it")
    _, order, kind = min(found)
    return order, kind


def _eps(nodes) -> float:
    """The constant added to the normalizer (max(|n|, exp(-m)) + eps); 1e-6 if none is found."""
    for n in nodes:
        if n.target == aten.add.Tensor and any(isinstance(a, torch.fx.Node) and a.target == aten.maximum.default
                                               for a in n.args[:2]):
            const = [a for a in n.args[:2] if isinstance(a, float)]
            if const:
                return const[0]
    return 1e-6


def run(gm: torch.fx.GraphModule, report: GraphReport) -> None:
    """Regions of the functions in KNOWN."""
    for label, nodes in _regions(gm.graph):
        reason = _replace_region(gm, report, label, nodes, ("zeros",))
        if reason:
            report.fallbacks.append(Fallback(FAMILY, f"{label}: {reason}", location(nodes[-1])))


def run_on_functions(gm: torch.fx.GraphModule, report: GraphReport, seeds) -> dict:
    """mLSTM-like code the structural passes did not match, proven as a whole function: for each
    seed (a logsigmoid left in the graph), the nodes of the user function that called it (by stack
    trace, one connected region per call) go through the same checks and numeric proof as KNOWN
    functions, with either start-state convention. This catches hand-written chunkwise code with
    its loop unrolled, and other styles of the same math. {seed: None if replaced, else why not}."""
    out: dict = {}
    for seed in seeds:
        if seed in out:  # part of a region already tried
            continue
        user = [fr for fr in _frames(seed) if not fr[0].startswith(_TORCH_DIR)]  # not inside nn.LogSigmoid etc.
        if not user:
            out[seed] = "no stack trace"
            continue
        frame = user[-1]
        label = f"function {frame[1]}"
        groups = _regions(gm.graph, lambda n, fr=frame: label if fr in _frames(n) else None)
        nodes = next((g for _, g in groups if seed in g), None)
        if nodes is None:
            out[seed] = "no region"
            continue
        members = set(nodes)
        reason = _replace_region(gm, report, label, nodes, ("none", "zeros"))
        for other in seeds:
            if other in members:
                out[other] = reason
    return out


def _replace_region(gm, report, label, nodes, kinds) -> str | None:
    """Replace one region by xaccel.mlstm if it proves equal; None, or the reason it was not."""
    graph = gm.graph
    region = set(nodes)
    where = location(nodes[-1])
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in region))
    outputs = [n for n in nodes if any(u not in region for u in n.users)]
    if len(outputs) != 1 or not isinstance(val(outputs[0]), torch.Tensor):
        return f"{len(outputs)} results leave the function (final states are not supported here)"
    out = outputs[0]
    eps = _eps(nodes)
    with unset_fake_temporarily():
        try:
            order, kind = _verify(nodes, inputs, out, eps, kinds)  # kind: the state kind, or why not
        except Exception as e:  # noqa: BLE001 - a region we cannot run is a region we do not replace
            order, kind = None, f"could not run it for verification ({type(e).__name__}: {e})"
    if order is None:
        return f"not replaced, {kind}"
    q, k, v, i, f = (inputs[x] for x in order)
    dtype = val(q).dtype
    if val(out).dtype != dtype:
        return "result dtype differs from q's"
    slower = kernel_refusal(val(q), val(k), val(v))
    if slower:
        return f"left as written: {slower}; the op's reference would run instead, slower than this code"
    with graph.inserting_before(out):
        if kind == "zeros":
            sizes = [graph.call_function(aten.sym_size.int, (q, d)) for d in range(4)]
            dv = graph.call_function(aten.sym_size.int, (v, 3))
            kw = dict(dtype=torch.float32, device=val(q).device)
            state = (graph.call_function(aten.zeros.default, ([sizes[0], sizes[1], sizes[3], dv],), kw),
                     graph.call_function(aten.zeros.default, ([sizes[0], sizes[1], sizes[3]],), kw),
                     graph.call_function(aten.zeros.default, ([sizes[0], sizes[1]],), kw))
        else:
            state = (None, None, None)
        fused = graph.call_function(torch.ops.xaccel.mlstm.default, (q, k, v, i, f, *state, eps, 64))
        h = graph.call_function(operator.getitem, (fused, 0))
    h.meta["val"] = val(out)
    out.replace_all_uses_with(h, delete_user_cb=lambda u: u not in region)
    for n in reversed(nodes):
        if not n.users:
            graph.erase_node(n)
    report.replacements.append(Replacement(FAMILY, "xaccel.mlstm", f"{label} (verified numerically)", where))
    return None
