"""mLSTM regions proven by running them, then replaced by xaccel.mlstm or xaccel.mlstm_step.

Code the structural walks do not know (a chunkwise loop unrolled into hundreds of nodes, an einsum
form, a loop of recurrent steps, transformers' in-file copy of the xlstm kernels) is found by its
data flow (regions.py) and then
1. its inputs get roles by shape: q, k, v [B, NH, S, D] (a step: [B, NH, D]), gates i, f [B, NH, S]
   or [B, NH, S, 1] (a step: [B, NH] or [B, NH, 1]), and optionally start states C0 [B, NH, DK, DV],
   n0 [B, NH, DK], m0 [B, NH] or [B, NH, 1]; every tensor it reads must get one;
2. it runs on random fp32 inputs of its real shapes, in three regimes of gates (_REGIMES), recording
   every value;
3. each assignment is compared with xaccel.mlstm / mlstm_step under each start (the given state,
   zeros as the xlstm kernels start, or none as the parallel form) and state convention (k scaled
   as ours, or q scaled as the xlstm package's, whose states are sqrt(DQK) times ours): h is the
   last node equal to the op's h within 1e-4 in every regime, and the final C, n, m the last nodes
   equal to the op's states, where any are;
4. what follows those results in the region stays in the graph (a silu(h) in the same layout);
   every other value of the region must be read only inside it;
5. exactly one input assignment may hold; it replaces the region.
A region that fails a step is reported with that step and left as it is.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, replace as replace_roles

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true

from torch_xaccel.report import Replacement

from .. import CONSTANT_FLOATS
from ..graph_utils import alias_base, location, val
from . import regions
from .matching import DYNAMIC_EPS, example_int, kernel_refusal
from .step import REPORTED

FAMILY = "mlstm"
aten = torch.ops.aten
TOL = 1e-4
MAX_PROOF_ELEMENTS = 1 << 28  # proofs run the region at its real shapes: cap one S x S fp32 tensor at 1 GiB
STATES = ("C", "n", "m")


@dataclass(frozen=True)
class Roles:
    """One reading of a region: which inputs are what, and how its states relate to the op's."""
    target: str            # "sequence" (xaccel.mlstm) or "step" (xaccel.mlstm_step)
    qkvif: tuple           # input positions of q, k, v, i, f
    state: tuple | None    # input positions of C0, n0, m0 when given
    start: str             # "given", "zeros" (C = n = 0, m = 0) or "none" (no start state)
    scale_q: bool          # states hold unscaled k (q carries 1/sqrt(DQK)): theirs = sqrt(DQK) x ours


class Refused(Exception):
    """A step of the proof failed; the message says which."""


# ---- roles by shape ---------------------------------------------------------------------------

def _assignments(shapes: dict) -> list[Roles]:
    """Every assignment of the inputs (position -> shape) to roles that the shapes allow."""
    out = []
    for q, k, v in itertools.permutations(shapes, 3):
        Q, V = shapes[q], shapes[v]
        if shapes[k] != Q or Q[:-1] != V[:-1] or len(Q) not in (3, 4):
            continue
        target = "sequence" if len(Q) == 4 else "step"
        B, H, DK, DV = Q[0], Q[1], Q[-1], V[-1]
        gates = (Q[:3], Q[:3] + (1,)) if target == "sequence" else ((B, H), (B, H, 1), (B, H, 1, 1))
        rest = [x for x in shapes if x not in (q, k, v)]
        for i, f in itertools.permutations(rest, 2):
            if shapes[i] not in gates or shapes[f] not in gates:
                continue
            others = [x for x in rest if x not in (i, f)]
            options = []
            if not others and target == "sequence":
                options = [(None, "none"), (None, "zeros")]
            elif len(others) == 3:  # n and m also with trailing unit dims (the xlstm package's recurrent step)
                options = [((C, n, m), "given") for C, n, m in itertools.permutations(others)
                           if shapes[C] == (B, H, DK, DV) and shapes[n] in ((B, H, DK), (B, H, DK, 1))
                           and shapes[m] in ((B, H), (B, H, 1), (B, H, 1, 1))]
            out += [Roles(target, (q, k, v, i, f), state, start, scale_q)
                    for state, start in options for scale_q in (False, True)]
    return out


# ---- running the region and the op -------------------------------------------------------------

class _Recorder(torch.fx.Interpreter):
    """Runs the region, keeping a copy of each float tensor of a result's shape as it is when
    computed (later in-place writes into a buffer do not change what an earlier node showed)."""

    def __init__(self, gm, keep):
        super().__init__(gm)
        self.keep, self.seen = keep, {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.name in self.keep and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.seen[self.keep[n.name]] = out.detach().clone()
        return out


_LOW = (torch.bfloat16, torch.float16)


def _in_fp32(x):
    """Arguments with fp16/bf16 dtypes (casts, buffers) as fp32: the proof checks the region's math,
    which its low-precision rounding only blurs; the op computes in fp32 anyway."""
    if isinstance(x, torch.dtype):
        return torch.float32 if x in _LOW else x
    if isinstance(x, (tuple, list)):
        return type(x)(_in_fp32(a) for a in x)
    if isinstance(x, dict):
        return {k: _in_fp32(a) for k, a in x.items()}
    return x


def _extract(nodes, inputs) -> tuple[torch.fx.GraphModule, dict]:
    g = torch.fx.Graph()
    env = {x: g.placeholder(f"in{k}") for k, x in enumerate(inputs)}
    names = {}
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
        env[n].args, env[n].kwargs = _in_fp32(env[n].args), _in_fp32(env[n].kwargs)
        names[env[n].name] = n
    g.output(None)
    return torch.fx.GraphModule(torch.nn.Module(), g), names


def _run(extracted, values, shapes: set) -> dict:
    """{node: its value} for the nodes whose shape is in `shapes`."""
    gm, names = extracted
    keep = {name: n for name, n in names.items()
            if isinstance(val(n), torch.Tensor) and _concrete_shape(val(n)) in shapes}
    rec = _Recorder(gm, keep)
    with torch.no_grad():
        rec.run(*values)
    return rec.seen


def _expected(roles: Roles, vals: list, eps: float, cache) -> dict:
    """What the op returns for these inputs, in the region's state convention. cache: (a dict, the
    regime): without a given state the two conventions differ only by a factor on C and n, so
    the op runs once for both."""
    memo, regime = cache
    if roles.target == "sequence" and roles.start != "given":
        key = (regime, roles.qkvif, roles.start)
        if key not in memo:
            memo[key] = _op(replace_roles(roles, scale_q=False), vals, eps)
        root = vals[roles.qkvif[0]].shape[-1] ** 0.5 if roles.scale_q else 1.0
        got = memo[key]
        return dict(h=got["h"], C=got["C"] * root, n=got["n"] * root, m=got["m"])
    return _op(roles, vals, eps)


def _op(roles: Roles, vals: list, eps: float) -> dict:
    from torch_xaccel.ops.mlstm import reference

    q, k, v, i, f = (vals[x] for x in roles.qkvif)
    B, H, DK = q.shape[0], q.shape[1], q.shape[-1]
    if roles.target == "step":
        C, n, m = (vals[x] for x in roles.state)
        h, C, n, m = reference.step(q, k, v, i.reshape(B, H), f.reshape(B, H), C, n.reshape(B, H, DK),
                                    m.reshape(B, H), eps, roles.scale_q)
        return dict(h=h, C=C, n=n, m=m)
    root = DK ** 0.5 if roles.scale_q else 1.0
    S = q.shape[2]
    if roles.start == "given":
        C, n, m = (vals[x] for x in roles.state)
        state = (C / root, n.reshape(B, H, DK) / root, m.reshape(B, H))
    elif roles.start == "zeros":
        state = (q.new_zeros(B, H, DK, v.shape[-1]), q.new_zeros(B, H, DK), q.new_zeros(B, H))
    else:
        state = (None, None, None)
    h, C, n, m = reference.forward(q, k, v, i.reshape(B, H, S), f.reshape(B, H, S), *state, eps=eps)
    return dict(h=h, C=C * root, n=n * root, m=m)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _result_shapes(roles: Roles, shapes: dict) -> list:
    """The shapes h and the final states may have under `roles`: the op's, or with unit dims
    ([B, NH, 1] or [B, NH, 1, 1] for m, [B, NH, DK, 1] for n, a step's h as [B, NH, 1, DV])."""
    Q, V = shapes[roles.qkvif[0]], shapes[roles.qkvif[2]]
    B, H, DK, DV = Q[0], Q[1], Q[-1], V[-1]
    return [V, V + (1,), V[:-1] + (1,) + V[-1:], (B, H, DK, DV), (B, H, DK), (B, H, DK, 1), (B, H), (B, H, 1),
            (B, H, 1, 1)]


def _units_dropped(shape) -> tuple:
    return tuple(d for d in shape if d != 1)


def _fits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The same values laid out alike up to unit dims ([B, NH, 1] for [B, NH])."""
    return got.numel() == want.numel() and _units_dropped(got.shape) == _units_dropped(want.shape)


def _last_match(nodes, runs: list, wants: list) -> tuple:
    """(the last node equal to `wants` in every run, its error), or (None, the closest error)."""
    best, closest = (None, None), float("inf")
    for n in nodes:
        if not all(n in seen and _fits(seen[n], w) for seen, w in zip(runs, wants)):
            continue
        err = _rel(runs[0][n].reshape(wants[0].shape), wants[0])
        if err <= TOL:  # the other regimes only for a candidate
            err = max(_rel(seen[n].reshape(w.shape), w) for seen, w in zip(runs, wants))
        closest = min(closest, err)
        if err <= TOL:
            best = (n, err)
    return best if best[0] is not None else (None, closest)


# ---- the proof ------------------------------------------------------------------------------

@dataclass
class Proof:
    roles: Roles
    outputs: dict          # "h", and those of "C", "n", "m" the region computes -> node
    kept: list             # the region's nodes the op replaces, graph order
    error: float


def _example(v, gen):
    """A random real fp32 tensor like fake value v, or v's concrete value."""
    if isinstance(v, torch.Tensor):
        return torch.randn([int(s) for s in v.shape], generator=gen, dtype=torch.float32).to(v.device)
    hint = getattr(getattr(v, "node", None), "hint", None)
    return hint if hint is not None else v


def _concrete_shape(v) -> tuple:
    return tuple(example_int(s) for s in v.shape)


# (input gate shift, forget gate shift) of each run. Forget gates near 1 as in trained models keep
# the test well conditioned, and the normalizer's row sum binds; all gates down, its floor exp(-m)
# binds (a wrong scale on q k^T shows only there); forget gates at 1 with small input gates, the
# start state's m dominates the final m (a zero start and none differ only there, and in eps)
_REGIMES = ((2.0, 2.0), (-6.0, -6.0), (-8.0, 8.0))


def _regime(base: list, gates: tuple, shift: tuple) -> list:
    out = list(base)
    for k, d in zip(gates, shift):
        out[k] = base[k] + d
    return out


def prove(region: regions.Region, eps: float, targets=("sequence", "step")) -> Proof:
    inputs = region.inputs
    roled = {k: _concrete_shape(val(x)) for k, x in enumerate(inputs)
             if isinstance(val(x), torch.Tensor) and x not in region.size_inputs}
    floats = [x for x in inputs if not isinstance(val(x), torch.Tensor) and not isinstance(val(x), torch.SymInt)]
    if floats:
        raise Refused(f"it reads a Python float from outside ({floats[0].name}): {DYNAMIC_EPS}")
    candidates = [r for r in _assignments(roled) if r.target in targets]
    if not candidates:
        shown = ", ".join(str(list(t)) for t in sorted(roled.values())[:6]) + (", ..." if len(roled) > 6 else "")
        raise Refused(f"its {len(roled)} input tensors ({shown}) are not q, k, v, i, f (and start states) by "
                      "their shapes")
    seq = [r for r in candidates if r.target == "sequence"]
    for r in seq:
        B, H, S = roled[r.qkvif[0]][:3]
        if B * H * S * S > MAX_PROOF_ELEMENTS:  # the region may hold S x S intermediates
            raise Refused(f"too large to prove by running it (B*H*S^2 = {B * H * S * S:.2e} > "
                          f"{MAX_PROOF_ELEMENTS:.0e})")
    gen = torch.Generator().manual_seed(0)
    base = [_example(val(x), gen) for x in inputs]
    proofs, closest, escapes, extracted, memo = [], float("inf"), [], None, {}
    for gates, group in itertools.groupby(sorted(candidates, key=lambda r: r.qkvif[3:]), key=lambda r: r.qkvif[3:]):
        group = list(group)
        shapes = {s for r in group for s in _result_shapes(r, roled)}
        regimes = [_regime(base, gates, shift) for shift in _REGIMES]
        try:
            extracted = extracted or _extract(region.nodes, inputs)
            runs = [_run(extracted, vals, shapes) for vals in regimes]
        except Exception as e:  # noqa: BLE001 - a region we cannot run is a region we do not replace
            raise Refused(f"could not run it on random inputs ({type(e).__name__}: {e})") from None
        for roles in group:
            wants = [_expected(roles, vals, eps, (memo, k)) for k, vals in enumerate(regimes)]
            proof, err, escaped = _try(region.nodes, runs, wants, roles)
            if proof is not None:
                proofs.append(proof)
            closest, escapes = min(closest, err), escapes or escaped
    if not proofs:
        if escapes:
            names = ", ".join(n.name for n in escapes[:3])
            raise Refused(f"a value other than h and the final states leaves it: {names}")
        raise Refused("no assignment of its inputs to (q, k, v, i, f) reproduces its output h "
                      f"(closest relative error {closest:.1e})")
    orders = {(p.roles.qkvif, p.roles.state) for p in proofs}
    if len(orders) != 1:
        raise Refused("several input assignments reproduce it")
    return min(proofs, key=lambda p: p.error)


def _try(nodes, runs, wants, roles) -> tuple:
    """(the proof for one assignment or None, h's closest error, the values that would escape)."""
    h, err = _last_match(nodes, runs, [w["h"] for w in wants])
    if h is None:
        return None, err, []
    outputs = {"h": h}
    members = set(nodes)
    read_outside = [n for n in nodes if any(u not in members for u in n.users)]
    for name in STATES:  # preferably a value the rest of the graph reads
        node, e = _last_match(read_outside, runs, [w[name] for w in wants])
        if node is None:
            node, e = _last_match(nodes, runs, [w[name] for w in wants])
        if node is not None:
            outputs[name], err = node, max(err, e)
    kept, _ = _cut(nodes, outputs)
    inside = set(kept)
    # a state equal to the op's but read only inside the region is no result
    outputs = {name: n for name, n in outputs.items() if name == "h" or any(u not in inside for u in n.users)}
    kept, escaped = _cut(nodes, outputs)
    return (None if escaped else Proof(roles, outputs, kept, err)), err, escaped


def _cut(nodes, outputs: dict) -> tuple[list, list]:
    """(the nodes the op replaces, the values among them read outside): the region less what
    only follows its results."""
    outs = set(outputs.values())
    members = set(nodes)
    before, todo = set(outs), list(outs)
    while todo:
        for a in todo.pop().all_input_nodes:
            if a in members and a not in before:
                before.add(a)
                todo.append(a)
    after, todo = set(), list(outs)
    while todo:
        for u in todo.pop().users:
            if u in members and u not in after and u not in outs:
                after.add(u)
                todo.append(u)
    kept = [n for n in nodes if n in before or n not in after]
    inside = set(kept)
    escaped = [n for n in kept if n not in outs and not regions.sizey(n) and any(u not in inside for u in n.users)]
    return kept, escaped


# ---- the replacement --------------------------------------------------------------------------

def _eps(nodes) -> float:
    """The constant added to the normalizer (max(|n|, exp(-m)) + eps); 1e-6 if none is found."""
    for n in nodes:
        if n.target == aten.add.Tensor and any(isinstance(a, torch.fx.Node) and a.target == aten.maximum.default
                                               for a in n.args[:2]):
            const = [a for a in n.args[:2] if isinstance(a, float)]
            if const:
                return const[0]
    return 1e-6


class _Builder:
    """Inserts nodes with their fake values (later passes read them)."""

    def __init__(self, graph, fake_mode):
        self.graph, self.fake_mode = graph, fake_mode

    def __call__(self, target, *args, **kwargs):
        node = self.graph.call_function(target, args, kwargs)
        if self.fake_mode is not None:
            fargs, fkwargs = torch.fx.node.map_arg((args, kwargs), val)
            with self.fake_mode:
                node.meta["val"] = target(*fargs, **fkwargs)
        return node

    def scale(self, x, dk, power):
        """x * DQK**power, for a static or a symbolic head dim."""
        if isinstance(dk, torch.fx.Node):
            return self(aten.mul.Tensor, x, self(operator.pow, dk, power))
        return self(aten.mul.Tensor, x, float(dk) ** power)

    def like(self, x, node):
        """x in `node`'s dtype and with its unit dims (the op's results have none of their own)."""
        want, got = val(node), val(x)
        for dim in _inserted_units(tuple(got.shape), tuple(want.shape)):
            x = self(aten.unsqueeze.default, x, dim)
        if want.dtype != got.dtype:
            x = self(aten._to_copy.default, x, dtype=want.dtype)
        return x

    def squeezed(self, x, rank):
        """x without its trailing unit dims beyond `rank` ([B, NH, 1, 1] -> [B, NH])."""
        while val(x).dim() > rank:
            x = self(aten.squeeze.dim, x, -1)
        return x


def _inserted_units(got: tuple, want: tuple) -> list:
    """The positions at which unsqueezing `got` one dim at a time gives `want` (the same sizes plus
    unit dims): each of `got`'s dims matched to the first equal one of `want` that leaves room for
    the rest (where two unit dims are adjacent, either choice gives the same tensor)."""
    dims, j = [], 0
    for pos, size in enumerate(want):
        if j < len(got) and statically_known_true(got[j] == size) and len(want) - pos >= len(got) - j:
            j += 1
        else:
            dims.append(pos)
    return dims


def _write_between(graph, inputs, lo, hi, region) -> torch.fx.Node | None:
    """A write from outside the region into one of `inputs` (or memory they share) between graph
    positions lo and hi: the op, reading them once, would see another value than the region."""
    bases = {alias_base(x) for x in inputs}
    for k, n in enumerate(graph.nodes):
        if lo <= k <= hi and n not in region and any(alias_base(w) in bases for w in regions.writes(n)):
            return n
    return None


def replace(gm: torch.fx.GraphModule, report, region: regions.Region, proof: Proof, eps: float) -> str:
    """Insert the op for a proven region; its report detail."""
    graph, roles, outs = gm.graph, proof.roles, proof.outputs
    ins = [region.inputs[x] for x in roles.qkvif + (roles.state or ())]
    q, k, v, i, f = ins[:5]
    kept = set(proof.kept)
    order = {n: j for j, n in enumerate(graph.nodes)}
    anchor = max(ins, key=order.__getitem__)
    readers = [u for o in outs.values() for u in o.users if u not in kept]
    if any(order[u] <= order[anchor] for u in readers):
        raise Refused("a result is read before all of its inputs exist")
    lo = min(order[anchor], min(order[n] for n in proof.kept))
    hi = max(order[n] for n in proof.kept)
    if _write_between(graph, ins, lo, hi, kept) is not None:
        raise Refused("an input is written in place while it runs")
    slower = kernel_refusal(val(q), val(k), val(v))
    if slower:
        raise Refused(f"left as written: {slower}; the op's reference would run instead, slower than this code")
    build = _Builder(graph, getattr(val(q), "fake_mode", None))
    dk = val(q).shape[-1]
    with graph.inserting_before(anchor.next):
        dk_arg = dk if isinstance(dk, int) else build(aten.sym_size.int, q, -1)
        if roles.target == "step":
            C, n, m = ins[5:]
            fused = build(torch.ops.xaccel.mlstm_step.default, q, k, v, build.squeezed(i, 2), build.squeezed(f, 2),
                          C, build.squeezed(n, 3), build.squeezed(m, 2), eps, roles.scale_q)
            got = dict(zip(("h", *STATES), (build(operator.getitem, fused, j) for j in range(4))))
        else:
            fused = build(torch.ops.xaccel.mlstm.default, q, k, v, build.squeezed(i, 3), build.squeezed(f, 3),
                          *_start_state(build, roles, ins, dk_arg), eps, 64)
            got = dict(zip(("h", *STATES), (build(operator.getitem, fused, j) for j in range(4))))
            if roles.scale_q:
                got["C"], got["n"] = (build.scale(got[s], dk_arg, 0.5) for s in ("C", "n"))
        new = {name: build.like(got[name], node) for name, node in outs.items()}
    if outs["h"].meta.get("stack_trace"):
        new["h"].meta["stack_trace"] = outs["h"].meta["stack_trace"]
    for name, node in outs.items():
        node.replace_all_uses_with(new[name], delete_user_cb=lambda u: u not in kept)
    taken = [n.meta[REPORTED] for n in proof.kept if REPORTED in n.meta]  # steps now part of this region
    report.replacements[:] = [r for r in report.replacements if not any(r is t for t in taken)]
    for n in reversed(proof.kept):
        if not n.users:
            graph.erase_node(n)
    start = {"given": "from its start state", "zeros": "from a zero state", "none": "no start state"}[roles.start]
    finals = [s for s in STATES if s in outs]
    return f"{start}{', final ' + '/'.join(finals) if finals else ''}"


def _start_state(build, roles, ins, dk_arg) -> tuple:
    q, v = ins[0], ins[2]
    if roles.start == "none":
        return None, None, None
    if roles.start == "given":
        C, n, m = ins[5:]
        n = build.squeezed(n, 3)
        if roles.scale_q:
            C, n = build.scale(C, dk_arg, -0.5), build.scale(n, dk_arg, -0.5)
        return C, n, build.squeezed(m, 2)
    B, H, DK, DV = (build(aten.sym_size.int, q, 0), build(aten.sym_size.int, q, 1), build(aten.sym_size.int, q, 3),
                    build(aten.sym_size.int, v, 3))
    kw = dict(dtype=torch.float32, device=val(q).device)
    return (build(aten.zeros.default, [B, H, DK, DV], **kw), build(aten.zeros.default, [B, H, DK], **kw),
            build(aten.zeros.default, [B, H], **kw))


def _analysed(region, eps, targets) -> Proof:
    try:
        return prove(region, eps, targets)
    except Refused:
        raise
    except Exception as e:  # noqa: BLE001 - a region we cannot analyse is a region we do not replace
        raise Refused(f"could not be analysed ({type(e).__name__}: {e})") from None


def run(gm: torch.fx.GraphModule, ctx, seeds) -> list:
    """Grow, prove and replace a region around each seed not yet inside one:
    [(the region's nodes, None if replaced else why not, where)]."""
    done: set = set()
    results = []
    targets = ("sequence", "step") if "mlstm_step" in ctx.config.patterns else ("sequence",)
    for seed in seeds:
        if seed in done or seed.graph is not gm.graph:
            continue
        region = regions.grow(gm.graph, seed)
        if region is None:
            continue
        done.update(region.nodes)
        where = location(seed)
        eps = _eps(region.nodes)
        try:
            with unset_fake_temporarily():
                proof = _analysed(region, eps, targets)
            where = location(proof.outputs["h"])
            detail = replace(gm, ctx.report, region, proof, eps)
        except Refused as e:
            if DYNAMIC_EPS in str(e):
                ctx.requests.add(CONSTANT_FLOATS)
            results.append((set(region.nodes), str(e), where))
            continue
        family, op = ("mlstm_step", "xaccel.mlstm_step") if proof.roles.target == "step" else (FAMILY, "xaccel.mlstm")
        ctx.report.replacements.append(Replacement(family, op, f"mLSTM proven numerically ({detail})", where))
        results.append((set(region.nodes), None, where))
    return results
