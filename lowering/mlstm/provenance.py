"""mLSTM regions proven by running them, then replaced by xaccel.mlstm or xaccel.mlstm_step.

Code the structural walk (parallel.py) does not know (a chunkwise loop unrolled into hundreds of
nodes, an einsum form, a loop of recurrent steps, transformers' in-file copy of the xlstm kernels)
is found by its data flow (regions.py) and then
1. its inputs get roles from data flow and shapes: f is what the region's log-sigmoids read; q, k,
   v [B, NH, S, D] (a step: [B, NH, D]), i [B, NH, S] or [B, NH, S, 1] (a step: [B, NH] or
   [B, NH, 1]), and optionally start states C0 [B, NH, DK, DV], n0 [B, NH, DK], m0 [B, NH] or
   [B, NH, 1]; every tensor it reads must get one, and more than proof.MAX_CANDIDATES readings
   refuse it unrun;
2. it runs on random inputs of its real shapes in fp32 and in float64 (the truth), in four regimes
   of gates (_REGIMES; the last with small q k^T and large input gates, where an eps shows),
   recording every value of a result's shape;
3. each reading is compared with xaccel.mlstm / mlstm_step under each start (the given state,
   zeros as the xlstm kernels start, or none as the parallel form), state convention (k scaled as
   ours, or q scaled as the xlstm package's, whose states are sqrt(DQK) times ours) and eps (each
   constant the region adds, or none): h is the last node the op reproduces by proof.Accuracy in
   every regime, and the final C, n, m the last nodes it reproduces, where any are;
4. what follows those results in the region stays in the graph (a silu(h) in the same layout);
   every other value of the region must be read only inside it;
5. exactly one input reading may hold; it replaces the region, with the eps it was proven with.
A region that fails a step is reported with that step and left as it is. Running costs the
region's own size several times, so a region over MAX_PROOF_ELEMENTS is refused unrun: the
structural walk takes the common spellings at every length.
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

from .. import CONSTANT_FLOATS, proof
from ..graph_utils import alias_base, location, val
from ..proof import Refused
from . import regions
from .matching import DYNAMIC_EPS, example_int, is_op, kernel_refusal
from .step import REPORTED

FAMILY = "mlstm"
aten = torch.ops.aten
# proofs run the region at its real shapes, in fp32 and float64, eight times: cap one S x S tensor,
# by where it runs (a CPU's float64 is slow: there a proof then costs about as much as Inductor's compile)
MAX_PROOF_ELEMENTS = {"cpu": 1 << 21, "cuda": 1 << 24}
STATES = ("C", "n", "m")


@dataclass(frozen=True)
class Roles:
    """One reading of a region: which inputs are what, and how its states relate to the op's."""
    target: str            # "sequence" (xaccel.mlstm) or "step" (xaccel.mlstm_step)
    qkvif: tuple           # input positions of q, k, v, i, f
    state: tuple | None    # input positions of C0, n0, m0 when given
    start: str             # "given", "zeros" (C = n = 0, m = 0) or "none" (no start state)
    scale_q: bool          # states hold unscaled k (q carries 1/sqrt(DQK)): theirs = sqrt(DQK) x ours
    eps: float = 0.0       # the constant the normalizer adds (0.0: none)


# ---- roles from data flow and shapes -------------------------------------------------------------

def forget_gate_inputs(region: regions.Region) -> set:
    """Positions of the region's inputs its log-sigmoids read (through the region's own nodes): the
    only candidates for f."""
    members = set(region.nodes)
    found, todo, seen = set(), [n for n in region.nodes if is_op(n, aten.log_sigmoid.default)], set()
    position = {x: k for k, x in enumerate(region.inputs)}
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if a in position:
                found.add(position[a])
            elif a in members:
                todo.append(a)
    return found


def _assignments(shapes: dict, forget: set, eps_values: tuple) -> list[Roles]:
    """The readings of the inputs (position -> shape) that data flow and shapes allow: f among
    `forget`, the rest by shape; more than proof.MAX_CANDIDATES is refused unenumerated."""
    fs = [f for f in forget if f in shapes]
    if len(fs) > 1:  # an mLSTM's log-sigmoids read one forget-gate tensor (or its time slices)
        raise Refused(f"its log-sigmoids read {len(fs)} different inputs, an mLSTM's one forget gate: not an mLSTM")
    triples = sum(sum(1 for k in shapes if k != q and shapes[k] == shapes[q])
                  * sum(1 for v in shapes if v != q and shapes[v][:-1] == shapes[q][:-1]) for q in shapes)
    if len(fs) * triples > 20 * proof.MAX_CANDIDATES:  # counted, not enumerated: an unrolled look-alike has hundreds
        raise Refused(f"too many ways to read its {len(shapes)} input tensors as q, k, v, i, f "
                      f"({len(fs)} inputs reach its log-sigmoids): left as written")
    out = []
    for f, q in itertools.product(fs, shapes):
        Q = shapes[q]
        ks = [k for k in shapes if k not in (f, q) and shapes[k] == Q]
        vs = [v for v in shapes if v not in (f, q) and shapes[v][:-1] == Q[:-1]]
        for k, v in ((k, v) for k in ks for v in vs if v != k):
            V = shapes[v]
            if len(Q) not in (3, 4):
                continue
            target = "sequence" if len(Q) == 4 else "step"
            B, H, DK, DV = Q[0], Q[1], Q[-1], V[-1]
            gates = (Q[:3], Q[:3] + (1,)) if target == "sequence" else ((B, H), (B, H, 1), (B, H, 1, 1))
            if shapes[f] not in gates:
                continue
            rest = [x for x in shapes if x not in (q, k, v, f)]
            for i in rest:
                if shapes[i] not in gates:
                    continue
                others = [x for x in rest if x != i]
                options = []
                if not others and target == "sequence":
                    options = [(None, "none"), (None, "zeros")]
                elif len(others) == 3:  # n and m also with trailing unit dims (the xlstm package's recurrent step)
                    options = [((C, n, m), "given") for C, n, m in itertools.permutations(others)
                               if shapes[C] == (B, H, DK, DV) and shapes[n] in ((B, H, DK), (B, H, DK, 1))
                               and shapes[m] in ((B, H), (B, H, 1), (B, H, 1, 1))]
                out += [(target, (q, k, v, i, f), state, start) for state, start in options]
                if len(out) > proof.MAX_CANDIDATES:
                    raise Refused(f"more than {proof.MAX_CANDIDATES} readings of its {len(shapes)} input tensors as "
                                  "q, k, v, i, f: left as written")
    # each reading under both state conventions and every eps: a few runs of the op each
    return [Roles(*reading, scale_q, eps) for reading in out for scale_q in (False, True) for eps in eps_values]


def eps_values(nodes) -> tuple:
    """The eps a reading may have: none, or a constant the region adds to a tensor (the normalizer's
    `+ eps`, wherever the user put it); the proof tells them apart."""
    found = []
    for n in nodes:
        if is_op(n, aten.add.Tensor, aten.add.Scalar):
            found += [a for a in n.args[:2] if isinstance(a, float) and 0.0 < a < 1e-2]
    return (0.0, *dict.fromkeys(found))


# ---- running the region and the op -------------------------------------------------------------

def _expected(roles: Roles, vals: list, cache) -> dict:
    """What the op returns for these inputs, in the region's state convention. cache: (a dict, the
    run's key): without a given state the two conventions differ only by a factor on C and n, so
    the op runs once for both."""
    memo, run_key = cache
    if roles.target == "sequence" and roles.start != "given":
        key = (run_key, roles.qkvif, roles.start, roles.eps)
        if key not in memo:
            memo[key] = _op(replace_roles(roles, scale_q=False), vals)
        root = vals[roles.qkvif[0]].shape[-1] ** 0.5 if roles.scale_q else 1.0
        got = memo[key]
        return dict(h=got["h"], C=got["C"] * root, n=got["n"] * root, m=got["m"])
    return _op(roles, vals)


def _op(roles: Roles, vals: list) -> dict:
    from torch_xaccel.ops.mlstm import reference

    q, k, v, i, f = (vals[x] for x in roles.qkvif)
    B, H, DK = q.shape[0], q.shape[1], q.shape[-1]
    eps = roles.eps
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


@dataclass
class _Runs:
    """The region's recorded values and the op's results in every regime, in fp32 and float64."""
    user32: list
    user64: list
    want32: list
    want64: list

    def accuracies(self, node, name: str) -> list | None:
        """proof.Accuracy of the op's `name` result against `node` in each regime (None: the node's
        values do not have that result's layout)."""
        out = []
        for u32, u64, w32, w64 in zip(self.user32, self.user64, self.want32, self.want64):
            if node not in u32 or node not in u64 or not _fits(u64[node], w64[name]):
                return None
            shape = w64[name].shape
            out.append(proof.accuracy(u64[node].reshape(shape), u32[node].reshape(shape), w64[name], w32[name]))
        return out


def _last_match(nodes, runs: _Runs, name: str) -> tuple:
    """(the last node the op's `name` result reproduces in every regime, its worst accuracy), or
    (None, the closest accuracy seen)."""
    best, closest = None, None
    for n in nodes:
        accs = runs.accuracies(n, name)
        if accs is None:
            continue
        acc = proof.worst(accs)
        if closest is None or acc.excess() < closest.excess():
            closest = acc
        if acc.holds():
            best = (n, acc)
    return best if best is not None else (None, closest)


# ---- the proof ------------------------------------------------------------------------------

@dataclass
class Proof:
    roles: Roles
    outputs: dict            # "h", and those of "C", "n", "m" the region computes -> node
    kept: list               # the region's nodes the op replaces, graph order
    accuracy: proof.Accuracy  # h's, in the regime farthest from its bound


def _example(v, gen, point: dict | None = None):
    """A random fp32 tensor of fake value v's shape at `point` (symbol -> size; None: the example
    sizes), or a size's value there: never int() of a symbolic size, which would specialise it."""
    if isinstance(v, torch.Tensor):
        return torch.randn(_shape_at(v, point), generator=gen, dtype=torch.float32).to(v.device)
    return _size_at(v, point) if isinstance(v, torch.SymInt) else v


def _size_at(size, point: dict | None) -> int:
    if isinstance(size, int) or point is None:
        return example_int(size)
    return int(size.node.expr.xreplace(point))


def _shape_at(v, point: dict | None) -> tuple:
    return tuple(_size_at(s, point) for s in v.shape)


def size_points(inputs) -> list:
    """Where to run the region: at its example sizes, and where any are symbolic, also at each
    symbol plus one. A replacement under dynamic shapes serves every size, so the proof must not
    hold only at the one it saw (a literal constant equal to a function of the size there)."""
    symbols = {}
    for x in inputs:
        v = val(x)
        sizes = v.shape if isinstance(v, torch.Tensor) else [v] if isinstance(v, torch.SymInt) else []
        for s in sizes:
            if isinstance(s, torch.SymInt):
                for sym in s.node.expr.free_symbols:  # each symbol's example value, wherever it first shows
                    symbols[sym] = s.node.shape_env.var_to_val.get(sym)
    if not symbols:
        return [None]
    if any(h is None for h in symbols.values()):
        raise Refused("a symbolic size without an example value (data-dependent): its values cannot be chosen "
                      "to prove it")
    return [None, {sym: int(h) + 1 for sym, h in symbols.items()}]


# (input gate shift, forget gate shift, scale of q, k, v) of each run. Forget gates near 1 as in
# trained models keep the test well conditioned, and the normalizer's row sum binds; all gates
# down, its floor exp(-m) binds (a wrong scale on q k^T shows only there); forget gates at 1 with
# small input gates, the start state's m dominates the final m (a zero start and none differ only
# there); large input gates with small q k^T, the row sum is tiny against exp(m): an eps shows
_REGIMES = ((2.0, 2.0, 1.0), (-6.0, -6.0, 1.0), (-8.0, 8.0, 1.0), (20.0, 2.0, 1e-2))


def _regime(base: list, gates: tuple, qkv: set, regime: tuple) -> list:
    *shift, scale = regime
    out = list(base)
    for k, d in zip(gates, shift):
        out[k] = base[k] + d
    for k in qkv:
        out[k] = base[k] * scale
    return out


def _in_float64(vals: list) -> list:
    return [v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in vals]


def prove(region: regions.Region, targets=("sequence", "step")) -> Proof:
    inputs = region.inputs
    roled = {k: _shape_at(val(x), None) for k, x in enumerate(inputs)
             if isinstance(val(x), torch.Tensor) and x not in region.size_inputs}
    floats = [x for x in inputs if not isinstance(val(x), torch.Tensor) and not isinstance(val(x), torch.SymInt)]
    if floats:
        raise Refused(f"it reads a Python float from outside ({floats[0].name}): {DYNAMIC_EPS}")
    forget = forget_gate_inputs(region)
    candidates = [r for r in _assignments(roled, forget, eps_values(region.nodes)) if r.target in targets]
    if not candidates:
        shown = ", ".join(str(list(t)) for t in sorted(roled.values())[:6]) + (", ..." if len(roled) > 6 else "")
        raise Refused(f"its {len(roled)} input tensors ({shown}) are not q, k, v, i, f (and start states) by "
                      "their shapes and data flow")
    for r in candidates:
        B, H, S = roled[r.qkvif[0]][:3]
        device = val(inputs[r.qkvif[0]]).device.type
        budget = MAX_PROOF_ELEMENTS.get(device, MAX_PROOF_ELEMENTS["cpu"])
        if r.target == "sequence" and B * H * S * S > budget:  # the region may hold S x S intermediates
            raise Refused(f"too large to prove by running it (B*H*S^2 = {B * H * S * S:.2e} > {budget:.1e} on "
                          f"{device}) and not a spelling the structural walk knows")
    gen = torch.Generator().manual_seed(0)
    points = size_points(inputs)
    bases = [[_example(val(x), gen, point) for x in inputs] for point in points]
    proofs, closest, escapes, memo = [], None, [], {}
    extracted = {}
    by_gates = lambda r: r.qkvif[3:]  # noqa: E731
    for gates, group in itertools.groupby(sorted(candidates, key=by_gates), key=by_gates):
        group = list(group)
        qkv = {p for r in group for p in r.qkvif[:3]}
        regimes = [_regime(base, gates, qkv, regime) for base in bases for regime in _REGIMES]
        at = [point for point in points for _ in _REGIMES]
        try:
            user = {dt: [_record(region, extracted, dt, vals, _shapes_of(group, vals), point)
                         for vals, point in zip(regimes, at)] for dt in (torch.float32, torch.float64)}
        except Exception as e:  # noqa: BLE001 - a region we cannot run is a region we do not replace
            raise Refused(f"could not run it on random inputs ({type(e).__name__}: {e})") from None
        for roles in group:
            first = _expected(roles, _in_float64(regimes[0]), (memo, (gates, 0, 64)))["h"]
            acc = _first_regime(region.nodes, user[torch.float64][0], user[torch.float32][0], first)
            if acc is None or acc.exact > max(acc.own, proof.EXACT_FLOOR):  # most readings fail here
                closest = _closer(closest, acc)
                continue
            want = {bits: [_expected(roles, vals if bits == 32 else _in_float64(vals), (memo, (gates, k, bits)))
                           for k, vals in enumerate(regimes)] for bits in (32, 64)}
            runs = _Runs(user[torch.float32], user[torch.float64], want[32], want[64])
            found, acc, escaped = _try(region.nodes, runs, roles)
            if found is not None:
                proofs.append(found)
            closest = _closer(closest, acc)
            escapes = escapes or escaped
    if not proofs:
        if escapes:
            names = ", ".join(n.name for n in escapes[:3])
            raise Refused(f"a value other than h and the final states leaves it: {names}")
        shown = f" (closest: {closest})" if closest is not None else ""
        raise Refused(f"no reading of its inputs as (q, k, v, i, f) makes xaccel.mlstm reproduce its output h{shown}")
    readings = {(p.roles.qkvif, p.roles.state) for p in proofs}
    if len(readings) != 1:
        raise Refused("several input readings reproduce it")
    return min(proofs, key=lambda p: p.accuracy.excess())


def _closer(a: proof.Accuracy | None, b: proof.Accuracy | None) -> proof.Accuracy | None:
    """The one nearer its bound (for the refusal's message)."""
    return min((x for x in (a, b) if x is not None), key=proof.Accuracy.excess, default=None)


def _shapes_of(group: list, vals: list) -> set:
    """The shapes any reading's results may have, for these input values."""
    shapes = {k: tuple(v.shape) for k, v in enumerate(vals) if isinstance(v, torch.Tensor)}
    return {s for r in group for s in _result_shapes(r, shapes)}


def _first_regime(nodes, user64: dict, user32: dict, h64: torch.Tensor) -> proof.Accuracy | None:
    """The closest any node's float64 value comes to the op's h in float64 in the first regime
    (its fp32 side not run yet: taken as the float64 one), before the op runs in the others."""
    best = None
    for n in nodes:
        if n in user64 and n in user32 and _fits(user64[n], h64):
            truth = user64[n].reshape(h64.shape)
            exact = proof.rel_error(h64, truth)
            acc = proof.Accuracy(proof.rel_error(user32[n].reshape(h64.shape), truth), exact, exact)
            best = acc if best is None or acc.excess() < best.excess() else best
    return best


def _record(region, extracted: dict, dtype, vals: list, shapes: set, point: dict | None) -> dict:
    """The region's values of the given result shapes, run in `dtype` (extracted once per dtype)
    at the sizes of `point`."""
    if dtype not in extracted:
        extracted[dtype] = proof.extract(region.nodes, region.inputs, dtype)
    keep = lambda n: isinstance(val(n), torch.Tensor) and _shape_at(val(n), point) in shapes  # noqa: E731
    return proof.record(extracted[dtype], vals if dtype == torch.float32 else _in_float64(vals), keep)


def _try(nodes, runs: _Runs, roles) -> tuple:
    """(the proof for one reading or None, h's closest accuracy, the values that would escape)."""
    h, acc = _last_match(nodes, runs, "h")
    if h is None:
        return None, acc, []
    outputs = {"h": h}
    members = set(nodes)
    read_outside = [n for n in nodes if any(u not in members for u in n.users)]
    for name in STATES:  # preferably a value the rest of the graph reads
        node, _ = _last_match(read_outside, runs, name)
        if node is None:
            node, _ = _last_match(nodes, runs, name)
        if node is not None:
            outputs[name] = node
    kept, _ = _cut(nodes, outputs)
    inside = set(kept)
    # a state equal to the op's but read only inside the region is no result
    outputs = {name: n for name, n in outputs.items() if name == "h" or any(u not in inside for u in n.users)}
    kept, escaped = _cut(nodes, outputs)
    return (None if escaped else Proof(roles, outputs, kept, acc)), acc, escaped


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


def replace(gm: torch.fx.GraphModule, report, region: regions.Region, found: Proof) -> str:
    """Insert the op for a proven region; its report detail."""
    graph, roles, outs = gm.graph, found.roles, found.outputs
    ins = [region.inputs[x] for x in roles.qkvif + (roles.state or ())]
    q, k, v, i, f = ins[:5]
    kept = set(found.kept)
    order = {n: j for j, n in enumerate(graph.nodes)}
    anchor = max(ins, key=order.__getitem__)
    readers = [u for o in outs.values() for u in o.users if u not in kept]
    if any(order[u] <= order[anchor] for u in readers):
        raise Refused("a result is read before all of its inputs exist")
    lo = min(order[anchor], min(order[n] for n in found.kept))
    hi = max(order[n] for n in found.kept)
    if _write_between(graph, ins, lo, hi, kept) is not None:
        raise Refused("an input is written in place while it runs")
    if len({val(x).dtype for x in (q, k, v)}) > 1:
        raise Refused("q, k, v dtypes differ (the op takes one)")
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
                          C, build.squeezed(n, 3), build.squeezed(m, 2), roles.eps, roles.scale_q)
            got = dict(zip(("h", *STATES), (build(operator.getitem, fused, j) for j in range(4))))
        else:
            fused = build(torch.ops.xaccel.mlstm.default, q, k, v, build.squeezed(i, 3), build.squeezed(f, 3),
                          *_start_state(build, roles, ins, dk_arg), roles.eps, 64)
            got = dict(zip(("h", *STATES), (build(operator.getitem, fused, j) for j in range(4))))
            if roles.scale_q:
                got["C"], got["n"] = (build.scale(got[s], dk_arg, 0.5) for s in ("C", "n"))
        new = {name: build.like(got[name], node) for name, node in outs.items()}
    if outs["h"].meta.get("stack_trace"):
        new["h"].meta["stack_trace"] = outs["h"].meta["stack_trace"]
    for name, node in outs.items():
        node.replace_all_uses_with(new[name], delete_user_cb=lambda u: u not in kept)
    taken = [n.meta[REPORTED] for n in found.kept if REPORTED in n.meta]  # steps now part of this region
    report.replacements[:] = [r for r in report.replacements if not any(r is t for t in taken)]
    for n in reversed(found.kept):
        if not n.users:
            graph.erase_node(n)
    start = {"given": "from its start state", "zeros": "from a zero state", "none": "no start state"}[roles.start]
    finals = [s for s in STATES if s in outs]
    eps = f"eps {roles.eps:g}" if roles.eps else "no eps"
    return f"{start}{', final ' + '/'.join(finals) if finals else ''}, {eps}"


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


def _analysed(region, targets) -> Proof:
    try:
        return prove(region, targets)
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
        try:
            with unset_fake_temporarily():
                found = _analysed(region, targets)
            where = location(found.outputs["h"])
            detail = replace(gm, ctx.report, region, found)
        except Refused as e:
            if DYNAMIC_EPS in str(e):
                ctx.requests.add(CONSTANT_FLOATS)
            results.append((set(region.nodes), str(e), where))
            continue
        family, op = ("mlstm_step", "xaccel.mlstm_step") if found.roles.target == "step" else (FAMILY, "xaccel.mlstm")
        ctx.report.replacements.append(Replacement(family, op, f"mLSTM proven numerically ({detail})", where))
        results.append((set(region.nodes), None, where))
    return results
