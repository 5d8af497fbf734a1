"""A seeded generator of hand-written sLSTM programs in the styles users write them, and their
differential check against eager (tests/slstm/test_fuzz.py runs it).

Each case is a Python function written out as source (a failing case prints it). It varies what
the sLSTM lowering must see through: the recurrence (per-head einsum in two R layouts, per-head
matmuls, one broadcast matmul, bmm, bmm of h tiled over the gates (repeat or expand) with R stored
as one [4, NH, D, D] tensor, a dense block-diagonal R built with torch.block_diag, a dense R of one
head), the gates' storage (flat gate-major, flat gate-minor, [B, 4, NH, D]) and how they
are split (chunk, unbind, split, indexing) in a random gate order, the states' layout ([B, NH, D],
[B, NH*D] head-major or unit-major), Wx batch- or time-major, given or projected before or inside
the loop, sliced by index, select or unbind, the bias added inside or outside the loop (or none),
outputs collected in a list (stack, cat), a preallocated buffer or only the last h, final states
returned or not, zero, given or mixed initial states, states cast every step; and the math: the
fresh rule per element (torch.where(n == 0, ...)), per batch (torch.all(n == 0)) or none,
clamped gates (torch.minimum or clamp(max=1)), n clamped (torch.maximum(n, 1), the op's form, or
clamp(min=1)), commutative arguments in either order, the stabilizer logsigmoid(f) + m named once
or written out wherever it is used (the textbook step), a first step written apart from a zero
start (`if t == 0:` skipping the recurrent product, setting m = i, or writing the fresh step out
with no state); random B, T (1 and odd included), NH, D;
grad or no_grad; static or dynamic shapes, or only the batch dims marked dynamic (then the compiled
function also runs at a second batch size).

A case is one of:
- "slstm": a true sLSTM. It must be replaced (xaccel.slstm for T >= 2, xaccel.slstm_step for T = 1)
  unless the generator predicts a refusal the lowering gives (`Case.refusal`: by design, an n clamp
  written clamp(min=1) from a given n in training, code without a fresh rule whose n is clamped or
  whose c, n, m are read; a known gap, NOT_A_VIEW); then nothing is replaced and the report says
  why. With dynamic=True either the sizes stayed symbolic (refused, "dynamic shapes") or Dynamo
  specialized them (replaced).
- "look-alike": one slip that makes it another function no variant of the op computes (a gate's
  activation changed, a sign flipped, a state mixed up). Nothing may be replaced.
- "reparam": a gate's pre-activation scaled or negated (2 f, -z): the same family of functions
  with other weights. The lowering may take it or not (the op's R, Wx, b are views: it refuses);
  a layout measured wrong would show as a mismatch.
- "exp-forget": an sLSTM with an exponential forget gate (exp(f + m - m'), m' = max(i, f + m)),
  which the op cannot express: nothing is replaced, and one report line names the construct
  (EXP_FORGET) or gives a reason predicted before it (dynamic shapes, TIE, NOT_A_VIEW).
Every case must equal eager (fp32, forward and every input's gradient, 1e-5 relative)."""
from __future__ import annotations

import dataclasses
import random
import textwrap
from dataclasses import dataclass, field

import torch

TOL = 1e-5  # relative, norm-wise, fp32, for the forward and every gradient

# slips that make the step another function: name -> (text of the step replaced, by what), or None
# where _update writes the slip itself
LOOK_ALIKES = {
    "z_sigmoid": ("torch.tanh(g_z)", "torch.sigmoid(g_z)"),
    "z_softsign": ("torch.tanh(g_z)", "torch.nn.functional.softsign(g_z)"),
    "o_tanh": ("torch.sigmoid(g_o)", "torch.tanh(g_o)"),
    "i_sigmoid": ("torch.exp(g_i - mn)", "torch.sigmoid(g_i - mn)"),
    "i_sign": ("torch.exp(g_i - mn)", "torch.exp(mn - g_i)"),
    "f_without_m": ("torch.exp(logfm - mn)", "torch.exp(F.logsigmoid(g_f) - mn)"),
    "c_gates_swapped": None,  # c' = i' c + f' tanh(z)
    "n_gates_swapped": None,  # n' = i' n + f'
    "h_from_old_c": None,  # h' = o c / n' (the old c)
}
REPARAMS = {
    "f_doubled": ("F.logsigmoid(g_f)", "F.logsigmoid(2.0 * g_f)"),
    "z_negated": ("torch.tanh(g_z)", "torch.tanh(-g_z)"),
    "o_halved": ("torch.sigmoid(g_o)", "torch.sigmoid(0.5 * g_o)"),
}
# the lowering's reasons for what it refuses by design (lowering/slstm/variants.py, loops.py, step.py)
TIE = "n' = clamp(n', min=1)"
EXP_FORGET = "exponential forget gate: the op takes a sigmoid forget gate"
NO_RULE_CLAMP = "no fresh rule and n clamped at 1"
NO_RULE_READ = "no fresh rule: its h equals"
DYNAMIC = "dynamic shapes"  # only where sizes stay symbolic: Dynamo specializes some (1, a loop's T, equal sizes)
# a gap, not a design choice: a dense R (and one computed from blocks, whose zeros the probes do not
# see) is measured as one head of H units; with the states unit-major, R's entries in that order
# are a permutation of R's, not a view, and the op's R is built from views only
NOT_A_VIEW = "R's layout is not a view of the recurrent weights"


@dataclass
class Case:
    seed: int
    source: str
    inputs: list  # (name, shape, kind, scale): kind and scale say how make_inputs draws it
    kind: str  # "slstm", "look-alike", "reparam" or "exp-forget"
    T: int
    mode: str  # "grad" (every input requires grad) or "no_grad"
    dynamic: bool | None | str  # torch.compile's dynamic=, or "batch": the batch dims marked dynamic
    refusal: list = field(default_factory=list)  # reasons the lowering gives (by design or NOT_A_VIEW; any one)
    style: dict = field(default_factory=dict)
    outcome: tuple | None = None  # after check: (slstm, slstm_step replacements, the sLSTM fallback reasons)

    def make_inputs(self) -> list:
        g = torch.Generator().manual_seed(self.seed)
        out = []
        for _, shape, kind, scale in self.inputs:
            if kind.startswith("n0"):
                t = torch.rand(shape, generator=g) + 0.2
                if kind == "n0_all_fresh":
                    t = torch.zeros(shape)
                elif kind == "n0_some_fresh":  # rows with n == 0 among others
                    mask = torch.rand(shape, generator=g) < 0.4
                    mask.view(-1)[0] = True
                    if mask.numel() > 1:
                        mask.view(-1)[-1] = False
                    t = torch.where(mask, torch.zeros_like(t), t)
            else:
                t = torch.randn(shape, generator=g) * scale
            out.append(t.requires_grad_(self.mode == "grad"))
        return out

    def reproducer(self) -> str:
        shapes = ", ".join(f"{n}={list(s)} ({k})" for n, s, k, _ in self.inputs)
        return textwrap.dedent(f"""\
            # xaccel sLSTM fuzz case, seed {self.seed}: {self.kind}, mode {self.mode}, dynamic={self.dynamic},
            # predicted refusal: {self.refusal or None}; inputs {shapes}
            # style: {self.style}
            """) + self.source + textwrap.dedent(f"""\
            # rerun: python -c "from tests.slstm.fuzz import check, generate; print(check(generate({self.seed})))"
            """)


def _pick(rng, *options, weights=None):
    return rng.choices(options, weights=weights)[0] if weights else rng.choice(options)


def generate(seed: int) -> Case:
    rng = random.Random(seed)
    B, T, NH, D = rng.choice([1, 2, 3]), rng.choice([1, 1, 2, 3, 4, 5, 7]), rng.choice([1, 2, 3]), \
        rng.choice([1, 2, 3, 4, 5])
    H = NH * D
    I = rng.choice([3, 5])  # noqa: E741 - the input width
    s = dict(
        rec=_pick(rng, "einsum_hgjk", "einsum_hkgj", "perhead", "matmul", "bmm", "blockdiag", "dense"),
        store=_pick(rng, "gate_major", "gate_minor", "op"),
        layout=_pick(rng, "bhd", "flat", "unit_major", weights=[3, 2, 1]),
        order="".join(rng.sample("ifzo", 4)) if rng.random() < 0.5 else "ifzo",
        time_major=rng.random() < 0.3,
        source=_pick(rng, "given", "proj_before", "proj_inside", weights=[3, 1, 1]),
        slicing=_pick(rng, "index", "select", "unbind"),
        bias=_pick(rng, "inside", "outside", "none", weights=[3, 2, 1]),
        rule=_pick(rng, "element", "batch", "none", weights=[4, 3, 1]),
        clamp_gates=_pick(rng, None, "minimum", "clamp"),
        clamp_n=_pick(rng, None, "maximum", "clamp"),
        # the kind and the initial states cycle with the seed, so that any run of seeds holds each
        init=[_pick(rng, "zeros", "one_zeros", weights=[3, 1]), "given",
              _pick(rng, "given", "mixed", "zeros")][seed % 3],
        n0=_pick(rng, "n0_positive", "n0_some_fresh", "n0_all_fresh", weights=[1, 3, 1]),
        out=_pick(rng, "stack1", "stack0", "cat", "buffer", "last"),
        finals=rng.random() < 0.35,
        cast=rng.random() < 0.15,
        swap=rng.random() < 0.5,  # commutative arguments the other way round
        h_form=_pick(rng, "o*c/n", "o*(c/n)", "c/n*o"),
        split=_pick(rng, "a", "b", "c", "d"),
    )
    kind = "look-alike" if seed % 4 == 3 else "reparam" if seed % 20 == 10 else "exp-forget" if seed % 20 == 6 \
        else "slstm"
    slip = rng.choice(list(LOOK_ALIKES if kind == "look-alike" else REPARAMS)) \
        if kind in ("look-alike", "reparam") else None
    s["slip"] = slip
    mode = "grad" if rng.random() < 0.85 else "no_grad"
    dynamic = _pick(rng, False, None, True, weights=[10, 3, 1])
    if seed % 5 == 2 and B >= 2:  # from the seed, not the rng: the other draws stay as they were
        dynamic = "batch"
    # drawn last, so that the styles above stay what they were for every seed
    s["textbook"] = rng.random() < 0.3
    if s["rec"] in ("bmm", "einsum_hgjk") and rng.random() < 0.5:
        s["rec"] = _pick(rng, "bmm4_repeat", "bmm4_expand")
    zero_start = s["init"] in ("zeros", "one_zeros")
    s["first"] = _pick(rng, None, "zero", "m_from_i", "no_state", weights=[2, 1, 1, 1]) \
        if zero_start and T >= 3 and kind != "look-alike" else None
    s["forget"] = "exp" if kind == "exp-forget" else "sigmoid"
    if kind == "exp-forget" and zero_start:
        T = max(T, 2)  # one step from zero states: its forget gate multiplies zeros, and the op is exact
    if s["init"] != "given":
        del s["n0"]
    source, inputs = _source(s, B, T, NH, D, H, I)
    return Case(seed, source, inputs, kind, T, mode, dynamic, _refusals(s, kind, mode, NH, D), s)


def _refusals(s, kind, mode, NH, D) -> list:
    """The reasons the lowering gives, by design, for not replacing the case (any one of them)."""
    if kind not in ("slstm", "exp-forget"):
        return []
    refusal = [EXP_FORGET] if kind == "exp-forget" else []
    if s["clamp_n"] == "clamp" and s["init"] == "given" and mode == "grad":
        refusal.append(TIE)
    # a first step that is the op's fresh step makes code without a fresh rule the op's (n >= 1 after it)
    fresh_first = s["first"] in ("m_from_i", "no_state") or (s["first"] == "zero" and s["rule"] != "none")
    if kind == "slstm" and s["rule"] == "none" and not fresh_first:
        if s["clamp_n"]:
            refusal.append(NO_RULE_CLAMP)
        if s["finals"]:
            refusal.append(NO_RULE_READ)
    if s["rec"] in ("dense", "blockdiag") and s["layout"] == "unit_major" and NH > 1 and D > 1:
        refusal.append(NOT_A_VIEW)
    return refusal


def _source(s, B, T, NH, D, H, I):  # noqa: E741
    """The program's source and its inputs [(name, shape, kind, scale)]."""
    store, layout, tm = s["store"], s["layout"], s["time_major"]
    swap = s["swap"]
    inputs = []
    body = []  # lines of fn's body (4 spaces added later)
    loop = []  # lines inside the time loop
    gshape = (4, NH, D) if store == "op" else (4 * H,)
    lead = ("T", "B") if tm else ("B", "T")
    sizes = {"B": B, "T": T}
    # --- the input term
    if s["source"] == "given":
        inputs.append(("Wx", tuple(sizes[k] for k in lead) + gshape, "x", 1.0))
        xname = "Wx"
    else:
        inputs.append(("x", tuple(sizes[k] for k in lead) + (I,), "x", 1.0))
        inputs.append(("W", (I, 4 * H), "W", I ** -0.5))
        xname = "x"
    shapes_line = f"{lead[0]}, {lead[1]} = {xname}.shape[0], {xname}.shape[1]"
    body += [f"NH, D = {NH}, {D}", "H = NH * D", shapes_line]
    # --- recurrent weights
    rshape = {"einsum_hgjk": (NH, 4, D, D), "einsum_hkgj": (NH, D, 4, D), "perhead": (NH, D, 4 * D),
              "matmul": (NH, D, 4 * D), "bmm": (NH, D, 4 * D), "blockdiag": (NH, 4, D, D),
              "dense": (H, 4 * H), "bmm4_repeat": (4, NH, D, D), "bmm4_expand": (4, NH, D, D)}[s["rec"]]
    inputs.append(("R", rshape, "R", 0.5 * (H if s["rec"] == "dense" else D) ** -0.5))
    if s["bias"] != "none":
        inputs.append(("b", gshape, "b", 0.5))
    # --- initial states
    sshape = "(B, NH, D)" if layout == "bhd" else "(B, H)"
    st = (B, NH, D) if layout == "bhd" else (B, H)
    if s["init"] == "zeros":
        body.append(f"h = {xname}.new_zeros{sshape}")
        body.append("c, n, m = torch.zeros_like(h), torch.zeros_like(h), torch.zeros_like(h)")
    elif s["init"] == "one_zeros":
        body.append(f"h = c = n = m = torch.zeros{sshape}")
    elif s["init"] == "given":
        inputs += [("h0", st, "h0", 0.5), ("c0", st, "c0", 1.0), ("n0", st, s["n0"], 1.0), ("m0", st, "m0", 1.0)]
        body.append("h, c, n, m = h0, c0, n0, m0")
    else:  # h given, c, n, m zero (the block's own state)
        inputs.append(("h0", st, "h0", 0.5))
        body.append("h = h0")
        body.append("c = torch.zeros_like(h0); n = torch.zeros_like(h0); m = torch.zeros_like(h0)")
    # --- the input term before the loop
    opv = ".view({}, {}, 4, NH, D)".format(*lead) if store == "op" else ""
    bias_out = s["bias"] == "outside" and s["source"] != "proj_inside"
    if s["source"] == "proj_before":
        body.append(f"Wx = (x @ W){opv}" if opv else "Wx = x @ W")
        if bias_out:
            body[-1] += " + b"
    elif bias_out:
        body.append("Wx = Wx + b" if not swap else "Wx = b + Wx")
    if s["rec"] == "blockdiag":  # one dense [H, 4H] matrix, gate-major, block-diagonal in each gate
        body.append("Rbd = torch.cat([torch.block_diag(*R[:, g].unbind(0)) for g in range(4)], 1)")
    tdim = 0 if tm else 1
    if s["source"] != "proj_inside" and s["slicing"] == "unbind":
        body.append(f"xs = Wx.unbind({tdim})")
    if s["out"] == "buffer":
        bshape = ("T, B" if tm else "B, T") + (", NH, D" if layout == "bhd" else ", H")
        body.append(f"out = {xname}.new_empty({bshape})")
    else:
        body.append("hs = []")
    # --- the step: input term
    if s["source"] == "proj_inside":
        xt = {"index": "x[t]" if tm else "x[:, t]", "select": f"x.select({tdim}, t)", "unbind": f"x.unbind({tdim})[t]"}
        proj = f"({xt[s['slicing']]} @ W)" + (".view(B, 4, NH, D)" if store == "op" else "")
        loop.append(f"x_t = {proj}" + (" + b" if s["bias"] == "outside" else ""))
    else:
        xt = {"index": "Wx[t]" if tm else "Wx[:, t]", "select": f"Wx.select({tdim}, t)", "unbind": "xs[t]"}
        loop.append(f"x_t = {xt[s['slicing']]}")
    # --- the recurrence, as [B, 4, NH, D] (gate-major, head, unit)
    hh = {"bhd": "h", "flat": "h.view(B, NH, D)", "unit_major": "h.view(B, D, NH).transpose(1, 2)"}[layout]
    hf = {"bhd": "h.reshape(B, H)", "flat": "h", "unit_major": "h.view(B, D, NH).transpose(1, 2).reshape(B, H)"}[layout]
    rec = {
        "einsum_hgjk": f"torch.einsum('bhk,hgjk->bghj', {hh}, R)",
        "einsum_hkgj": f"torch.einsum('bhk,hkgj->bghj', {hh}, R)",
        "perhead": "torch.stack([hh[:, k] @ R[k] for k in range(NH)], 1).view(B, NH, 4, D).transpose(1, 2)",
        "matmul": "torch.matmul(hh.unsqueeze(2), R).view(B, NH, 4, D).transpose(1, 2)",
        "bmm": "torch.bmm(hh.transpose(0, 1), R).view(NH, B, 4, D).permute(1, 2, 0, 3)",
        # R [4, NH, D_in, D_out]: h tiled over the gates, one bmm over (gate, head)
        "bmm4_repeat": "torch.bmm(hh.transpose(0, 1).repeat(4, 1, 1), R.view(4 * NH, D, D))"
                       ".view(4, NH, B, D).permute(2, 0, 1, 3)",
        "bmm4_expand": "torch.bmm(hh.transpose(0, 1).unsqueeze(0).expand(4, NH, B, D).reshape(4 * NH, B, D), "
                       "R.reshape(4 * NH, D, D)).view(4, NH, B, D).transpose(0, 2).transpose(1, 2)",
        "blockdiag": f"({hf} @ Rbd).view(B, 4, NH, D)",
        "dense": f"({hf} @ R).view(B, 4, NH, D)",
    }[s["rec"]]
    recurrent = [f"hh = {hh}"] if s["rec"] in ("perhead", "matmul", "bmm", "bmm4_repeat", "bmm4_expand") else []
    conv = {"gate_major": ".reshape(B, 4 * H)", "gate_minor": ".permute(0, 2, 3, 1).reshape(B, 4 * H)", "op": ""}
    recurrent.append(f"rec = {rec}{conv[store]}")
    terms = ["x_t", "rec"] + (["b"] if s["bias"] == "inside" else [])
    if swap:
        terms.reverse()
    recurrent.append("raw = " + " + ".join(terms))
    if s["first"] in ("zero", "no_state"):  # the first step skips the recurrent product
        loop += ["if t == 0:", "    raw = " + " + ".join(x for x in terms if x != "rec"), "else:"]
        loop += ["    " + ln for ln in recurrent]
    else:
        loop += recurrent
    # --- the gates, split in storage order, each in the states' layout
    split = s["split"]
    if store == "gate_major":
        gs = {"a": "raw.chunk(4, -1)", "b": "torch.split(raw, H, dim=1)", "c": "raw.view(B, 4, H).unbind(1)",
              "d": "[raw[:, k * H:(k + 1) * H] for k in range(4)]"}[split]
        flat = True
    elif store == "gate_minor":
        gs = {"a": "raw.view(B, H, 4).unbind(-1)", "b": "[raw.view(B, H, 4)[..., k] for k in range(4)]",
              "c": "[g.squeeze(-1) for g in raw.view(B, H, 4).chunk(4, -1)]",
              "d": "raw.view(B, H, 4).unbind(2)"}[split]
        flat = True
    else:
        gs = {"a": "raw.unbind(1)", "b": "[raw[:, k] for k in range(4)]",
              "c": "[g.squeeze(1) for g in raw.chunk(4, 1)]", "d": "[g.squeeze(1) for g in raw.split(1, dim=1)]"}[split]
        flat = False
    loop.append(f"gs = {gs}")
    to_state = {(True, "bhd"): "{}.view(B, NH, D)", (True, "flat"): "{}",
                (True, "unit_major"): "{}.view(B, NH, D).transpose(1, 2).reshape(B, H)",
                (False, "bhd"): "{}", (False, "flat"): "{}.reshape(B, H)",
                (False, "unit_major"): "{}.transpose(1, 2).reshape(B, H)"}[(flat, layout)]
    for pos, g in enumerate(s["order"]):
        loop.append(f"g_{g} = " + to_state.format(f"gs[{pos}]"))
    loop += _update(s)
    # --- outputs
    if s["out"] == "buffer":
        loop.append("out[t] = h" if tm else "out[:, t] = h")
    else:
        loop.append("hs.append(h)")
    head = "for t in range(T):"
    ret = {"stack1": "torch.stack(hs, 1)", "stack0": "torch.stack(hs, 0)", "buffer": "out",
           "cat": "torch.cat([y.unsqueeze(1) for y in hs], dim=1)", "last": "hs[-1]"}[s["out"]]
    body += [head] + ["    " + ln for ln in loop]
    body.append(f"return {ret}, c, n, m" if s["finals"] else f"return {ret}")
    args = ", ".join(name for name, *_ in inputs)
    src = "import torch\nimport torch.nn.functional as F\n\n\ndef fn(" + args + "):\n" + \
        "\n".join("    " + ln for ln in body) + "\n"
    return src, inputs


def _update(s) -> list:
    """The state update in the style chosen, with the slip (if any) applied."""
    swap, slip = s["swap"], s["slip"]
    lines = []
    if s["cast"]:  # the xlstm package's habit: states in the input dtype each step (a no-op here)
        lines.append("c, n, m = c.to(x_t.dtype), n.to(x_t.dtype), m.to(x_t.dtype)")
    forget = "g_f" if s["forget"] == "exp" else "F.logsigmoid(g_f)"
    lines.append(f"logfm = m + {forget}" if swap else f"logfm = {forget} + m")
    stabilizer = ["mn = torch.maximum(logfm, g_i)" if swap else "mn = torch.max(g_i, logfm)"]
    if s["rule"] == "element":
        stabilizer.append("mn = torch.where(n == 0, g_i, mn)")
    elif s["rule"] == "batch":
        stabilizer.append("mn = torch.where(torch.all(n == 0), g_i, mn)" if not swap else
                          "mn = torch.where((n == 0).all(), g_i, mn)")
    if s["first"] == "m_from_i":  # the first step's stabilizer from i alone
        stabilizer = ["if t == 0:", "    mn = g_i", "else:", *("    " + ln for ln in stabilizer)]
    lines += stabilizer
    lines.append("ig = torch.exp(g_i - mn)")
    lines.append("fg = torch.exp(logfm - mn)")
    if s["clamp_gates"] == "minimum":
        lines.append("ig, fg = torch.minimum(ig, torch.ones_like(ig)), torch.minimum(fg, torch.ones_like(fg))")
    elif s["clamp_gates"] == "clamp":
        lines.append("ig, fg = ig.clamp(max=1.0), torch.clamp(fg, max=1)")
    c_line = "c = c * fg + torch.tanh(g_z) * ig" if swap else "c = fg * c + ig * torch.tanh(g_z)"
    n_line = "n = ig + fg * n" if swap else "n = fg * n + ig"
    if slip == "c_gates_swapped":
        c_line = "c = ig * c + fg * torch.tanh(g_z)"
    if slip == "n_gates_swapped":
        n_line = "n = ig * n + fg"
    nc = {None: [], "maximum": ["n = torch.maximum(n, torch.ones_like(n))"],
          "clamp": ["n = torch.clamp(n, min=1.0)" if not swap else "n = n.clamp(min=1)"]}[s["clamp_n"]]
    h_line = {"o*c/n": "h = torch.sigmoid(g_o) * c / n", "o*(c/n)": "h = torch.sigmoid(g_o) * (c / n)",
              "c/n*o": "h = c / n * torch.sigmoid(g_o)"}[s["h_form"]]
    if slip == "h_from_old_c":
        lines += [n_line, *nc, h_line, c_line]
    else:
        lines += [c_line, n_line, *nc, h_line]
    lines.append("m = mn")
    table = LOOK_ALIKES if s["slip"] in LOOK_ALIKES else REPARAMS
    if slip and table[slip]:
        old, new = table[slip]
        hit = [k for k, ln in enumerate(lines) if old in ln]
        assert hit, (slip, lines)
        lines[hit[0]] = lines[hit[0]].replace(old, new, 1)
    if s["textbook"]:
        lines = _inline_logfm(lines)
    if s["first"] == "no_state":  # the first step writes the fresh step out, from no state
        lines = ["if t == 0:", "    c, n, m = torch.tanh(g_z), torch.ones_like(g_i), g_i",
                 "    h = torch.sigmoid(g_o) * c / n", "else:", *("    " + ln for ln in lines)]
    return lines


def _inline_logfm(lines) -> list:
    """The textbook step: the stabilizer F + m written out wherever logfm is used."""
    k = next(k for k, ln in enumerate(lines) if ln.startswith("logfm = "))
    expr = lines[k][len("logfm = "):]
    return [ln.replace("logfm", expr) for j, ln in enumerate(lines) if j != k]


# ---- the check --------------------------------------------------------------------------------------

def program(case: Case):
    env: dict = {}
    exec(compile(case.source, f"<slstm fuzz case {case.seed}>", "exec"), env)
    return env["fn"]


def _run(fn, inputs, mode):
    ctx = torch.enable_grad if mode == "grad" else torch.no_grad
    with ctx():
        outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = None
    if mode == "grad":
        g = torch.Generator().manual_seed(11)  # a random cotangent per output: every output's gradient counts
        loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return outs, grads


def _batch_dims(case: Case) -> dict:
    """{input name: its batch dim} (the generator's layout: x or Wx time-major or not, states [B, ...])."""
    return {"x": int(case.style["time_major"]), "Wx": int(case.style["time_major"]), "h0": 0, "c0": 0, "n0": 0,
            "m0": 0}


def _batch_of(case: Case) -> int:
    name, shape, _, _ = case.inputs[0]
    return shape[_batch_dims(case)[name]]


def _batch_marked(case: Case, inputs: list) -> list:
    dims = _batch_dims(case)
    for (name, _, _, _), t in zip(case.inputs, inputs):
        if name in dims:
            torch._dynamo.maybe_mark_dynamic(t, dims[name])
    return inputs


def _at_batch(case: Case, B: int) -> list:
    """The case's inputs drawn anew at batch size B."""
    dims = _batch_dims(case)
    shapes = [(n, tuple(B if n in dims and k == dims[n] else d for k, d in enumerate(shape)), kind, scale)
              for n, shape, kind, scale in case.inputs]
    return dataclasses.replace(case, inputs=shapes, seed=case.seed + 7919).make_inputs()


def _differs(got_run, want_run, case: Case) -> str | None:
    """Why a compiled run differs from eager's (forward and every input's gradient), or None."""
    (got, got_g), (want, want_g) = got_run, want_run
    for k, (o, w) in enumerate(zip(got, want)):
        if o.shape != w.shape or _err(o, w) > TOL:
            return f"output {k}: {tuple(o.shape)}, {_err(o, w):.2e} relative to eager"
    for (name, _, _, _), g, w in zip(case.inputs, got_g or (), want_g or ()):
        if (g is None) != (w is None) or (w is not None and _err(g, w) > TOL):
            return f"d{name} differs from eager"
    return None


def _err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(case: Case) -> str | None:
    """None when the compiled program equals eager (fp32: forward and every input's gradient
    within TOL, norm-wise), an sLSTM is replaced unless the lowering refuses it by a reason the
    generator predicts (then the report names it), and a look-alike is never replaced."""
    from torch_xaccel.report import Report, collect

    fn = program(case)
    base = case.make_inputs()
    clone = lambda ts: [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]  # noqa: E731
    want, want_g = _run(fn, clone(base), case.mode)
    torch._dynamo.reset()
    batch = case.dynamic == "batch"
    compiled = torch.compile(fn, backend="xaccel", dynamic=None if batch else case.dynamic)
    with collect() as graphs:
        got, got_g = _run(compiled, _batch_marked(case, clone(base)) if batch else clone(base), case.mode)
        if batch:  # the same compiled function at another batch size
            other = _at_batch(case, _batch_of(case) + 2)
            why = _differs(_run(compiled, _batch_marked(case, clone(other)), case.mode),
                           _run(fn, clone(other), case.mode), case)
            if why:
                return f"at batch size {_batch_of(case) + 2}: {why}"
    report = Report(graphs=graphs)
    if len(got) != len(want):
        return f"{len(got)} outputs, eager {len(want)}"
    for k, (o, w) in enumerate(zip(got, want)):
        if o.shape != w.shape or o.dtype != w.dtype or o.requires_grad != w.requires_grad:
            return f"output {k}: {tuple(o.shape)} {o.dtype} requires_grad={o.requires_grad}, eager " \
                   f"{tuple(w.shape)} {w.dtype} requires_grad={w.requires_grad}"
        if not torch.isfinite(w).all():
            return f"output {k} of eager is not finite (the generator's inputs are out of range)"
        if _err(o, w) > TOL:
            return f"output {k} differs from eager: {_err(o, w):.2e} relative\n{report}"
    for (name, _, _, _), g, w in zip(case.inputs, got_g or (), want_g or ()):
        if (g is None) != (w is None):
            return f"d{name}: {'None' if g is None else 'a tensor'}, eager {'None' if w is None else 'a tensor'}"
        if w is not None and _err(g, w) > TOL:
            return f"d{name} differs from eager: {_err(g, w):.2e} relative\n{report}"
    backend = [f.reason for f in report.fallbacks if f.family == "backend"]
    if backend:
        return f"the backend fell back: {backend}"
    counts = report.counts()
    replaced = counts["slstm"] + counts["slstm_step"]
    reasons = [f.reason for f in report.fallbacks if f.family.startswith("slstm")]
    case.outcome = (counts["slstm"], counts["slstm_step"], reasons)
    if case.kind == "look-alike" and replaced:
        return f"a look-alike ({case.style['slip']}) was replaced\n{report}"
    if case.kind == "exp-forget" and len(reasons) != 1:
        return f"an exponential forget gate gets {len(reasons)} report lines, not one: {reasons}"
    if case.kind not in ("slstm", "exp-forget"):
        return None
    expected = case.refusal + ([DYNAMIC] if case.dynamic else [])
    if case.refusal or (case.dynamic and not replaced):
        if replaced:
            return f"replaced, where the lowering refuses by design ({case.refusal})\n{report}"
        if not any(r in reason for r in expected for reason in reasons):
            return f"not replaced, but the report does not give the reason predicted ({expected}): {reasons}"
        return None
    want_counts = (1, 0) if case.T > 1 else (0, 1)
    if (counts["slstm"], counts["slstm_step"]) != want_counts:
        return f"slstm={counts['slstm']}, slstm_step={counts['slstm_step']}, expected {want_counts}: {reasons}"
    return None
