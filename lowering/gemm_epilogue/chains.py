"""Pattern family "gemm_epilogue": a GEMM followed by an elementwise chain, rewritten to one
torch.ops.xaccel.gemm_epilogue call.

GEMM anchors (ATen pre-dispatch forms of F.linear, nn.Linear, x @ W.T, torch.matmul, torch.mm,
torch.addmm, torch.bmm) are canonicalised to (a, b, b_transposed, bias). From each anchor the chain
grows one user at a time while that user is a supported unary or binary op whose other operand
is a Python number, an earlier value of the chain, or a tensor that lines up with the output as a
full tensor, a row vector, a column vector or a 0-d scalar. Values that the rest of the graph also
reads become extra outputs. Two GEMMs that share `a` and meet in one binary op (SwiGLU:
silu(x @ W1.T) * (x @ W3.T)) become one dual-GEMM op. Every refusal is reported with its reason.
"""
from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from torch_xaccel.ops.gemm_epilogue import elementwise
from torch_xaccel.ops.gemm_epilogue.epilogue_ir import Epilogue, read_by_vjp
from torch_xaccel.report import Fallback, GraphReport, Replacement

from .. import PassContext
from ..graph_utils import is_one, location, mutated_nodes, reported_with_region, same_shape, val

FAMILY = "gemm_epilogue"
LEFT_TO_OTHER_GEMM = "its other input is a GEMM whose own chain takes it"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICES = ("cpu", "cuda")
aten = torch.ops.aten

GEMM_TARGETS = {aten.linear.default: "linear", aten.matmul.default: "matmul", aten.mm.default: "mm",
                aten.addmm.default: "addmm", aten.bmm.default: "bmm"}

def _targets(kind: str) -> set:
    return {t for op in elementwise.OPS if op.kind == kind for t in op.aten}


UNARY_TARGETS = _targets("unary")
BINARY_TARGETS = _targets("binary")
# activation gradients (g, x): taken only in backward graphs (run(..., backward=True)), where a
# GEMM's result is the gradient flowing into an activation; the IR has no vjp for them
GRAD_TARGETS = _targets("grad")


# With the Inductor rest: reductions that Inductor fuses a pointwise producer into (it computes the
# producer's values in the reduction's own loads and never writes them), and the casts and views a
# value may pass through on its way there. A chain whose every use ends in one of these gains
# nothing from the fused kernel: Inductor fuses the chain anyway, and cuBLAS alone runs the GEMM
# faster than the kernel with the chain (e.g. an LM head whose softcap feeds the cross-entropy;
# docs/benchmarks.md).
FUSED_INTO = {aten.cross_entropy_loss, aten._log_softmax, aten.log_softmax, aten._softmax, aten.softmax,
              aten.logsumexp, aten.nll_loss, aten.nll_loss_forward, aten.sum, aten.mean, aten.amax, aten.amin}
PASSED_THROUGH = {aten.to, aten._to_copy, aten.flatten, aten.view, aten.reshape, aten._unsafe_view}


def fused_into_reductions(node: torch.fx.Node) -> str | None:
    """The reductions (names) where every use of node's value ends, through casts, views and
    pointwise ops; None if any use reaches something else (a GEMM, an xaccel op, a graph output)."""
    sinks, todo, seen = set(), [node], {node}
    while todo:
        for u in todo.pop().users:
            packet = getattr(u.target, "overloadpacket", None)
            if packet in FUSED_INTO:
                sinks.add(packet.__name__)
            elif packet in PASSED_THROUGH or torch.Tag.pointwise in getattr(u.target, "tags", ()):
                if u not in seen:
                    seen.add(u)
                    todo.append(u)
            else:
                return None
    return ", ".join(sorted(sinks)) or None


@dataclass
class Gemm:
    node: torch.fx.Node
    a: torch.fx.Node
    b: torch.fx.Node
    b_transposed: bool
    bias: torch.fx.Node | None
    folded: list[torch.fx.Node]  # transpose views absorbed into b_transposed


def transposed_source(node) -> torch.fx.Node | None:
    """W when `node` is a transpose of the last two dims of a 2-D or 3-D W, else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    src = node.args[0] if node.args else None
    v = val(src)
    if not isinstance(v, torch.Tensor) or v.dim() not in (2, 3):
        return None
    t, nd = node.target, v.dim()
    if t in (aten.t.default, aten.numpy_T.default) and nd == 2:
        return src
    if t == aten.permute.default and list(node.args[1]) == ([1, 0] if nd == 2 else [0, 2, 1]):
        return src
    if t == aten.transpose.int and {d % nd for d in node.args[1:3]} == {nd - 2, nd - 1}:
        return src
    if t == getattr(aten, "mT", None) or (hasattr(aten, "adjoint") and t == aten.adjoint.default):
        return src
    return None


def as_gemm(node: torch.fx.Node) -> Gemm | str | None:
    """Canonical GEMM for a node, a reason string when it is a GEMM we cannot take, None otherwise."""
    if node.op != "call_function" or node.target not in GEMM_TARGETS:
        return None
    kind = GEMM_TARGETS[node.target]
    args = list(node.args)
    bias = None
    if kind == "linear":
        a, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
        b, b_t, folded = w, True, []
    else:
        if kind == "addmm":
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                return "addmm with beta or alpha other than 1"
            bias, args = args[0], args[1:]
        a, b = args[0], args[1]
        src = transposed_source(b)
        b, b_t, folded = (src, True, [b]) if src is not None else (b, False, [])
    va, vb, vo = val(a), val(b), val(node)
    if not all(isinstance(v, torch.Tensor) for v in (va, vb, vo)):
        return "operands are not tensors"
    if va.dtype not in DTYPES or vb.dtype != va.dtype or vo.dtype != va.dtype:
        return f"dtype {va.dtype}/{vb.dtype} not supported (fp32, fp16, bf16, both the same)"
    if va.device.type not in DEVICES or vb.device != va.device:
        return f"device {va.device} not supported"
    if va.dim() < 2:
        return "1-D input"
    if vb.dim() == 3 and va.dim() != 3 or vb.dim() not in (2, 3):
        return f"operand ranks {va.dim()} x {vb.dim()} not supported (need [..., K] x 2-D or batched 3-D x 3-D)"
    if bias is not None and not isinstance(bias, torch.fx.Node):
        return "bias is not a tensor"
    return Gemm(node, a, b, b_t, bias, folded)


@dataclass
class Chain:
    """An epilogue under construction: IR nodes plus the FX nodes it replaces."""
    ir: list[dict] = field(default_factory=list)
    ids: dict = field(default_factory=dict)  # fx node -> IR id of its value
    operands: list[torch.fx.Node] = field(default_factory=list)
    gemms: list[Gemm] = field(default_factory=list)
    nodes: list[torch.fx.Node] = field(default_factory=list)  # replaced FX nodes, in apply order
    grad_ops: bool = False  # may take activation-gradient ops (a backward graph)

    def _add(self, d: dict) -> int:
        self.ir.append(d)
        return len(self.ir) - 1

    def _operand(self, node, bcast) -> int:
        if node not in self.operands:
            self.operands.append(node)
        return self._add({"op": "load", "operand": self.operands.index(node), "bcast": bcast})

    def _arg(self, spec) -> int:
        kind, x = spec[0], spec[1]
        if kind == "ref":
            return self.ids[x]
        if kind == "const":
            return self._add({"op": "const", "value": x})
        return self._operand(x, spec[2])

    def add_gemm(self, g: Gemm, out_val) -> str | None:
        idx = self._add({"op": "acc", "index": len(self.gemms)})
        if g.bias is not None:
            bcast = operand_bcast(g.bias, out_val)
            if bcast.startswith("!"):
                return f"bias: {bcast[1:]}"
            idx = self._add({"op": "add", "in": [idx, self._operand(g.bias, bcast)]})
        self.gemms.append(g)
        self.ids[g.node] = idx
        self.nodes.append(g.node)
        return None

    def apply(self, node, desc) -> None:
        op, specs = desc
        self.ids[node] = self._add({"op": op, "in": [self._arg(s) for s in specs]})
        self.nodes.append(node)

    def epilogue(self, outputs) -> Epilogue:
        ep = Epilogue(tuple(self.ir), tuple(self.ids[n] for n in outputs))
        ep.validate()
        return ep

    def n_ops(self) -> int:
        """Elementwise ops beyond each GEMM's own bias add."""
        return len(self.nodes) - len(self.gemms)


def operand_bcast(node, out_val) -> str:
    """How a tensor operand lines up with the chain's output, or '!reason'."""
    v = val(node)
    if not isinstance(v, torch.Tensor):
        return "!operand is not a tensor"
    if v.device != out_val.device:
        return f"!operand on {v.device}, output on {out_val.device}"
    shape, out = v.shape, out_val.shape
    if v.dim() == 0 or all(is_one(s) for s in shape):
        return "scalar" if v.dtype.is_floating_point else "!integer scalar tensor"
    if v.dtype != out_val.dtype:
        return f"!operand dtype {v.dtype} differs from {out_val.dtype} (a cast the epilogue does not model)"
    if same_shape(shape, out):
        return "full"
    if v.dim() <= len(out) and all(is_one(s) for s in shape[:-1]) and same_shape(shape[-1:], out[-1:]):
        return "row"
    if v.dim() == len(out) and is_one(shape[-1]) and same_shape(shape[:-1], out[:-1]):
        return "col"
    return f"!operand shape {tuple(shape)} broadcasts against {tuple(out)} in a way the epilogue does not support"


def describe_step(u: torch.fx.Node, cur: torch.fx.Node, chain: Chain):
    """(op, arg specs) when `u` can extend the chain whose current value is `cur`, else a reason."""
    name = getattr(u.target, "__name__", str(u.target))
    if u.op != "call_function" or not elementwise.takes(u.target):
        return f"{name} is not an elementwise op the epilogue supports"
    out, cv = val(u), val(cur)
    if not isinstance(out, torch.Tensor) or out.dtype != cv.dtype:
        return f"{name} changes the dtype"
    if not same_shape(out.shape, cv.shape):
        return f"{name} broadcasts the output to a larger shape"
    if u.target in UNARY_TARGETS:
        if u.args[0] is not cur:
            return f"{name} does not take the chain value"
        return elementwise.from_aten(u.target, u.args, u.kwargs).name, [("ref", cur)]
    if u.target in GRAD_TARGETS:
        return _grad_step(u, cur, chain, name, cv)
    if u.kwargs.get("alpha", 1) != 1 or len(u.args) > 2:
        return f"{name} with alpha other than 1"
    op = elementwise.from_aten(u.target).name
    x, y = u.args[0], u.args[1]
    if u.target == aten.rsub.Scalar:  # rsub(x, y) = y - x
        x, y = y, x
    specs = _arg_specs(name, (x, y), cur, chain, cv)
    return specs if isinstance(specs, str) else (op, specs)


def _grad_step(u: torch.fx.Node, cur: torch.fx.Node, chain: Chain, name: str, cv):
    """An activation-gradient op (g, x): only in a backward graph, both arguments tensors."""
    if not chain.grad_ops:
        return f"{name} in a graph that trains (second derivatives are not modelled)"
    op = elementwise.from_aten(u.target, u.args, u.kwargs).name
    if op == "relu_grad" and (u.args[2] if len(u.args) > 2 else u.kwargs.get("threshold")) != 0:
        return f"{name} with a threshold other than 0"
    g, x = u.args[0], u.args[1]
    if not (isinstance(g, torch.fx.Node) and isinstance(x, torch.fx.Node)):
        return f"{name} with a non-tensor argument"
    specs = _arg_specs(name, (g, x), cur, chain, cv)
    return specs if isinstance(specs, str) else (op, specs)


def _arg_specs(name: str, args, cur: torch.fx.Node, chain: Chain, cv):
    """Specs for a binary step's two arguments (one of them the chain value), or a reason."""
    if cur not in args:
        return f"{name} does not take the chain value"
    specs = []
    for arg in args:
        if isinstance(arg, torch.fx.Node) and arg in chain.ids:
            specs.append(("ref", arg))
        elif isinstance(arg, torch.fx.Node):
            if isinstance(as_gemm(arg), Gemm) and len(arg.users) == 1:
                return f"{name}: {LEFT_TO_OTHER_GEMM}"
            bcast = operand_bcast(arg, cv)
            if bcast.startswith("!"):
                return f"{name}: {bcast[1:]}"
            specs.append(("operand", arg, bcast))
        elif isinstance(arg, bool):  # eager raises for some ops (x - True) where the fused op would not
            return f"{name} with a Python bool operand"
        elif isinstance(arg, numbers.Number) and not isinstance(arg, complex):
            specs.append(("const", float(arg)))
        else:
            return f"{name} with a {type(arg).__name__} operand"
    return specs


def _reads_too_late(chain: Chain, u: torch.fx.Node, desc, order: dict) -> bool:
    """True when a new operand of step `u` is computed after a node outside the chain already reads
    a chain value: the fused op (placed after its last input) would come too late for that reader."""
    new_ops = [s[1] for s in desc[1] if s[0] == "operand"]
    if not new_ops:
        return False
    outside = [x for n in chain.nodes for x in n.users if x not in chain.ids and x is not u]
    latest = max(order[o] for o in new_ops)
    return any(order[x] <= latest for x in outside)


def extend(chain: Chain, cur: torch.fx.Node, mutated: set) -> str:
    """Grow the chain from `cur` while exactly one user can join it; return why it stopped."""
    order = {n: i for i, n in enumerate(cur.graph.nodes)}
    while True:
        if cur in mutated:
            return f"stopped after {cur.name}: it is written in place later"
        verdicts = [(u, describe_step(u, cur, chain)) for u in cur.users if u.op != "output"]
        fusible = [(u, d) for u, d in verdicts if not isinstance(d, str)]
        if len(fusible) != 1:
            if len(fusible) > 1:
                return f"stopped after {cur.name}: several users could continue the chain"
            # a chain that ends at a non-pointwise op (a GEMM, a norm, a view) ended naturally;
            # only a pointwise op we could not take is worth a note in the report
            reasons = [d for u, d in verdicts if torch.Tag.pointwise in getattr(u.target, "tags", ())
                       and not d.endswith(LEFT_TO_OTHER_GEMM)]
            return f"stopped: {reasons[0]}" if reasons else ""
        u, desc = fusible[0]
        if _reads_too_late(chain, u, desc, order):
            return f"stopped before {u.name}: its operand is computed after a use of the chain's value"
        cur = u
        chain.apply(cur, desc)


def _back_path(node: torch.fx.Node):
    """(Gemm, path) when `node` is a GEMM followed only by single-user unary/scalar ops, else None."""
    path = []
    while True:
        if len(node.users) != 1:
            return None
        g = as_gemm(node)
        if isinstance(g, Gemm):
            return g, path[::-1]
        if node.op != "call_function":
            return None
        if node.target in UNARY_TARGETS:
            prev = node.args[0]
        elif node.target in BINARY_TARGETS:
            tensor_args = [x for x in node.args[:2] if isinstance(x, torch.fx.Node)]
            if len(tensor_args) != 1:
                return None
            prev = tensor_args[0]
        else:
            return None
        if not isinstance(prev, torch.fx.Node):
            return None
        path.append(node)
        node = prev


def dual_chain(m: torch.fx.Node) -> Chain | None:
    """SwiGLU-style match: op(f(a @ b0), g(a @ b1)) with both sides single-use."""
    if m.op != "call_function" or m.target not in BINARY_TARGETS or m.target == aten.rsub.Scalar:
        return None
    x, y = m.args[0], m.args[1]
    if not (isinstance(x, torch.fx.Node) and isinstance(y, torch.fx.Node)) or x is y:
        return None
    sides = [_back_path(x), _back_path(y)]
    if None in sides:
        return None
    (g0, p0), (g1, p1) = sides
    if g0.a is not g1.a or g0.b_transposed != g1.b_transposed or val(g0.b).dim() != 2 or val(g1.b).dim() != 2:
        return None
    if not same_shape(val(g0.node).shape, val(g1.node).shape):
        return None
    chain = Chain()
    for g, path in ((g0, p0), (g1, p1)):
        if chain.add_gemm(g, val(g.node)) is not None:
            return None
        cur = g.node
        for n in path:
            desc = describe_step(n, cur, chain)
            if isinstance(desc, str):
                return None
            chain.apply(n, desc)
            cur = n
    desc = describe_step(m, x, chain)
    if isinstance(desc, str):
        return None
    chain.apply(m, desc)
    return chain


def _fake_outputs(args, n_out):
    fake_mode = next((v.fake_mode for v in map(val, [args[0], *args[1], *args[2]]) if hasattr(v, "fake_mode")), None)
    if fake_mode is None:
        return [None] * n_out
    fakes = [val(args[0]), [val(b) for b in args[1]], [val(o) for o in args[2]], *args[3:]]
    with fake_mode:
        return torch.ops.xaccel.gemm_epilogue.default(*fakes)


def rewrite(gm: torch.fx.GraphModule, chain: Chain, mutated: set, stop_note: str, report: GraphReport,
            training: bool) -> bool:
    """Replace the chain's FX nodes with one xaccel op; False (and a fallback entry) if unsafe."""
    graph = gm.graph
    first = chain.gemms[0].node
    where = location(first)
    chain_set = set(chain.nodes)
    final = chain.nodes[-1]
    outputs = [final] + [n for n in chain.nodes if n is not final and any(u not in chain_set for u in n.users)]
    ins = [chain.gemms[0].a, *(g.b for g in chain.gemms), *chain.operands]
    written = [n.name for n in ins if n in mutated]
    if written:
        report.fallbacks.append(Fallback(FAMILY, f"inputs written in place in the graph: {', '.join(written)}", where))
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = max([first, *ins], key=order.__getitem__)
    later_users = [u for n in outputs for u in n.users if u not in chain_set]
    if any(order[u] <= order[anchor] for u in later_users):
        report.fallbacks.append(Fallback(FAMILY, "an operand is computed after a use of an intermediate", where))
        return False
    ep = chain.epilogue(outputs)
    if training:
        # emit the values the backward reads (e.g. the pre-activation), as eager would save them,
        # so the backward recomputes neither a GEMM nor the chain
        extra = tuple(sorted(i for i in read_by_vjp(ep) if i not in ep.outputs))
        ep = Epilogue(ep.nodes, ep.outputs + extra)
    args = (chain.gemms[0].a, [g.b for g in chain.gemms], list(chain.operands), ep.to_json(),
            chain.gemms[0].b_transposed)
    with graph.inserting_after(anchor):
        fused = graph.call_function(torch.ops.xaccel.gemm_epilogue.default, args)
    if first.meta.get("stack_trace"):
        fused.meta["stack_trace"] = first.meta["stack_trace"]
    fakes = _fake_outputs(args, len(ep.outputs))
    fused.meta["val"] = fakes
    prev = fused
    for i, (n, fake) in enumerate(zip(outputs, fakes)):
        with graph.inserting_after(prev):
            get = graph.call_function(operator.getitem, (fused, i))
        get.meta["val"] = fake
        if n.meta.get("stack_trace"):
            get.meta["stack_trace"] = n.meta["stack_trace"]
        n.replace_all_uses_with(get, delete_user_cb=lambda u: u not in chain_set)
        prev = get
    for n in sorted(chain_set, key=order.__getitem__, reverse=True):
        graph.erase_node(n)
    for g in chain.gemms:
        for t in g.folded:
            if not t.users:
                graph.erase_node(t)
    names = "+".join(GEMM_TARGETS[g.node.target] for g in chain.gemms)
    pattern = f"{names} -> {ep.describe()}" + (f" (+{len(outputs) - 1} extra output)" if len(outputs) > 1 else "")
    report.replacements.append(Replacement(FAMILY, "xaccel.gemm_epilogue", pattern, where, stop_note))
    return True


def run(gm: torch.fx.GraphModule, ctx: PassContext, backward: bool = False) -> None:
    """training: gradients will flow (the forward then also emits what the backward reads).
    backward: an aot_autograd backward graph (backward.py): activation-gradient ops may
    join a chain, and GEMMs with nothing to fuse (most weight gradients) are not reported. With the
    Inductor rest, a chain whose values only feed reductions Inductor fuses them into is left to
    Inductor (FUSED_INTO)."""
    report, training = ctx.report, ctx.training
    graph = gm.graph
    mutated = mutated_nodes(graph)
    gone: set = set()

    def alive(n):
        return n not in gone

    def left_to_inductor(chain: Chain, what: str) -> bool:
        if report.fallback_backend != "inductor" or backward or not ctx.config.leave_to_inductor:
            return False
        inside = set(chain.nodes)
        ends = [n for n in chain.nodes if n is chain.nodes[-1] or any(u not in inside for u in n.users)]
        sinks = [fused_into_reductions(n) for n in ends]
        if not all(sinks):
            return False
        report.fallbacks.append(Fallback(FAMILY, f"{what} -> {chain.epilogue(ends).describe()}: left to Inductor, "
                                         f"which fuses the chain into {', '.join(dict.fromkeys(sinks))}; "
                                         "cuBLAS runs the GEMM", location(chain.gemms[0].node)))
        return True

    for m in list(graph.nodes):  # dual GEMMs first: their GEMMs would otherwise match alone
        if alive(m):
            chain = dual_chain(m)
            if chain is not None:
                chain.grad_ops = backward
                note = extend(chain, chain.nodes[-1], mutated)
                if left_to_inductor(chain, "+".join(GEMM_TARGETS[g.node.target] for g in chain.gemms)):
                    gone.update(chain.nodes)
                elif rewrite(gm, chain, mutated, note, report, training):
                    gone.update(chain.nodes)
    for node in list(graph.nodes):
        if not alive(node):
            continue
        g = as_gemm(node)
        if g is None:
            continue
        if isinstance(g, str):
            if not reported_with_region(node):
                report.fallbacks.append(Fallback(FAMILY, f"{GEMM_TARGETS[node.target]}: {g}", location(node)))
            continue
        chain = Chain(grad_ops=backward)
        reason = chain.add_gemm(g, val(node))
        if reason is not None:
            if not reported_with_region(node):
                report.fallbacks.append(Fallback(FAMILY, f"{GEMM_TARGETS[node.target]}: {reason}", location(node)))
            continue
        note = extend(chain, node, mutated)
        if chain.n_ops() == 0:
            if backward or reported_with_region(node):
                continue
            what = GEMM_TARGETS[node.target] + (" + bias" if g.bias is not None else "")
            report.fallbacks.append(Fallback(FAMILY, f"{what} alone: nothing to fuse, stays on ATen"
                                             + (f" ({note})" if note else ""), location(node)))
            continue
        if left_to_inductor(chain, GEMM_TARGETS[node.target]):
            gone.update(chain.nodes)
        elif rewrite(gm, chain, mutated, note, report, training):
            gone.update(chain.nodes)
