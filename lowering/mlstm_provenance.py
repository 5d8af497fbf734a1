"""mLSTM code from known libraries, found by where it came from and proven by running it.

The xlstm package's chunkwise kernel (`mlstm_chunkwise__native_autograd`) unrolls a Python loop
over chunks with einops rearranges: hundreds of ATen nodes whose exact shape changes with the
sequence length. Instead of a structural pattern, this pass
1. takes the nodes whose stack trace runs through that function, split into connected regions;
2. requires each region to read exactly five float tensors (3 of rank 4, 2 of rank 3) besides
   zeros() start states, and to produce exactly one tensor that the rest of the graph reads;
3. runs the region on random inputs of the real shapes (fp32) and compares it with
   xaccel::mlstm for every assignment of the inputs to (q, k, v, i, f), with the library's start
   state (C = n = 0, m = 0); exactly one assignment must agree within 1e-4;
4. replaces the region with that call.
A region that fails any step is reported and left as it is.
"""
from __future__ import annotations

import itertools
import operator
import re

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torch_xaccel.report import Fallback, GraphReport, Replacement

from .graph_utils import location, val

FAMILY = "mlstm"
aten = torch.ops.aten
KNOWN = {  # (file suffix, function) -> a short name for the report
    ("mlstm_kernels/torch/chunkwise/native/fwbw.py", "mlstm_chunkwise__native_autograd"): "xlstm native chunkwise",
}
TOL = 1e-4


def _origin(node) -> str | None:
    trace = node.meta.get("stack_trace") or ""
    for path, _, fn in re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace):
        for (suffix, name), label in KNOWN.items():
            if fn == name and path.endswith(suffix):
                return label
    return None


def _regions(graph) -> list[tuple[str, list]]:
    members = {n: _origin(n) for n in graph.nodes if n.op == "call_function"}
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


def _verify(nodes, inputs, output, eps):
    """The (q, k, v, i, f) order of `inputs` under which xaccel::mlstm reproduces the region, or a reason.
    Inputs made by zeros() (the start states a wrapper passes in) stay zero: they are part of the
    function being recognised, not data."""
    from torch_xaccel.ops.mlstm import reference

    gen = torch.Generator().manual_seed(0)
    values = [torch.zeros([int(s) for s in val(x).shape], device=val(x).device) if x.target in _ZEROS
              else _example(val(x), gen) for x in inputs]
    tensors = [k for k, x in enumerate(inputs) if isinstance(val(x), torch.Tensor) and x.target not in _ZEROS]
    rank4 = [k for k in tensors if val(inputs[k]).dim() == 4]
    rank3 = [k for k in tensors if val(inputs[k]).dim() == 3]
    if len(tensors) != 5 or len(rank4) != 3 or len(rank3) != 2:
        return None, f"reads {len(tensors)} tensors, not q, k, v (4-D) and i, f (3-D)"
    for k in rank3:  # forget gates near 1 as in trained models: keeps the test well conditioned
        values[k] = values[k] + 2.0
    with torch.no_grad():
        want = _extract(nodes, inputs, output)(*values)
        if not isinstance(want, torch.Tensor):
            return None, "the region's result is not a tensor"
        found = []
        for (q, k, v), (i, f) in itertools.product(itertools.permutations(rank4), itertools.permutations(rank3)):
            Q, K, V, I, Fg = (values[x] for x in (q, k, v, i, f))
            if Q.shape != K.shape or Q.shape[:-1] != V.shape[:-1] or tuple(V.shape[:-1]) != tuple(want.shape[:-1]) \
                    or V.shape[-1] != want.shape[-1]:
                continue
            B, H, S, DK = Q.shape
            zeros = (Q.new_zeros(B, H, DK, V.shape[-1]), Q.new_zeros(B, H, DK), Q.new_zeros(B, H))
            got = reference(Q, K, V, I, Fg, *zeros, eps=eps)[0]
            if ((got - want.float()).norm() / want.float().norm()).item() <= TOL:
                found.append((q, k, v, i, f))
    if len(found) != 1:
        return None, ("no assignment of its inputs to (q, k, v, i, f) reproduces it" if not found
                      else "several input assignments reproduce it")
    return found[0], None


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
    graph = gm.graph
    for label, nodes in _regions(graph):
        region = set(nodes)
        where = location(nodes[-1])
        inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in region))
        outputs = [n for n in nodes if any(u not in region for u in n.users)]
        if len(outputs) != 1 or not isinstance(val(outputs[0]), torch.Tensor):
            report.fallbacks.append(Fallback(FAMILY, f"{label}: {len(outputs)} results leave the kernel "
                                                     "(final states are not supported yet)", where))
            continue
        out = outputs[0]
        eps = _eps(nodes)
        with unset_fake_temporarily():
            try:
                order, reason = _verify(nodes, inputs, out, eps)
            except Exception as e:  # noqa: BLE001 - a region we cannot run is a region we do not replace
                order, reason = None, f"could not run it for verification ({type(e).__name__}: {e})"
        if order is None:
            report.fallbacks.append(Fallback(FAMILY, f"{label}: not replaced, {reason}", where))
            continue
        q, k, v, i, f = (inputs[x] for x in order)
        dtype = val(q).dtype
        if val(out).dtype != dtype:
            report.fallbacks.append(Fallback(FAMILY, f"{label}: result dtype differs from q's", where))
            continue
        with graph.inserting_before(out):
            sizes = [graph.call_function(aten.sym_size.int, (q, d)) for d in range(4)]
            dv = graph.call_function(aten.sym_size.int, (v, 3))
            kw = dict(dtype=torch.float32, device=val(q).device)
            C0 = graph.call_function(aten.zeros.default, ([sizes[0], sizes[1], sizes[3], dv],), kw)
            n0 = graph.call_function(aten.zeros.default, ([sizes[0], sizes[1], sizes[3]],), kw)
            m0 = graph.call_function(aten.zeros.default, ([sizes[0], sizes[1]],), kw)
            fused = graph.call_function(torch.ops.xaccel.mlstm.default, (q, k, v, i, f, C0, n0, m0, eps, 64))
            h = graph.call_function(operator.getitem, (fused, 0))
        h.meta["val"] = val(out)
        out.replace_all_uses_with(h, delete_user_cb=lambda u: u not in region)
        for n in reversed(nodes):
            if not n.users:
                graph.erase_node(n)
        report.replacements.append(Replacement(FAMILY, "xaccel.mlstm", f"{label} (verified numerically)", where))
