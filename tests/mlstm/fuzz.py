"""A seeded generator of the stabilized parallel mLSTM written in random styles, and its differential
check against eager and a float64 truth (tests/mlstm/test_fuzz.py runs it).

Each case writes the formula with a random causal mask (masked_fill of ~tril, of triu or of a float
tril compared with 0, where of tril or of an arange comparison, the -inf in either branch, the
mask before or after adding i), the row maximum as amax, max(...).values, max(...)[0] or a tuple
unpacking, the 1/sqrt(DQK) scale on q k^T, q, k or C, @ or einsum products, gates [B, NH, S] or
[B, NH, S, 1] (sometimes the xlstm package's zero-padded cumsum), logsigmoid, log(sigmoid) or
-softplus(-f), the normalizer with maximum or max, with an eps (1e-6 or 1e-5, added to the
maximum) or none, the commutative ops' arguments in either order, the projections as transposed
views or contiguous, random S (odd ones included, sometimes up to 4096) and head dims,
requires_grad on some inputs, grad or no_grad, dynamic shapes or not, and in a quarter of the
cases inputs that expose an eps (small q k^T, large input gates); sometimes with a slip that
makes it another function (a wrong scale, a missing mask, the eps inside the maximum), which must
not be replaced and must still equal eager."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

# name -> (the mask's line, how it drops the upper triangle of {x})
MASKS = {
    "masked_fill_tril": ("mask = torch.tril(torch.ones(S, S, dtype=torch.bool, device=q.device))",
                         "({x}).masked_fill(~mask, float('-inf'))"),
    "masked_fill_triu": ("mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=q.device), diagonal=1)",
                         "({x}).masked_fill(mask, -math.inf)"),
    "masked_fill_float": ("mask = torch.ones(S, S, device=q.device).tril()",
                          "({x}).masked_fill(mask == 0, float('-inf'))"),
    "where_tril": ("mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()",
                   "torch.where(mask, {x}, float('-inf'))"),
    "where_arange": ("t_idx = torch.arange(S, device=q.device)",
                     "torch.where(t_idx[:, None] >= t_idx[None, :], {x}, float('-inf'))"),
    "where_drop_first": ("upper = torch.triu(torch.ones(S, S, dtype=torch.bool, device=q.device), 1)",
                         "torch.where(upper, float('-inf'), {x})"),
}
ROW_MAX = ["m = logD.amax(dim=-1, keepdim=True)", "m = torch.amax(logD, -1, keepdim=True)",
           "m = torch.max(logD, -1, keepdim=True).values", "m = logD.max(-1, keepdim=True)[0]",
           "m, _ = torch.max(logD, dim=-1, keepdim=True)"]
LOG_FORGET = ["F.logsigmoid(f)", "torch.log(torch.sigmoid(f))", "-F.softplus(-f)"]


@dataclass
class Case:
    seed: int
    source: str
    shapes: dict
    grads: set
    mode: str
    dynamic: bool | None
    exact_form: bool  # the formula as the op defines it (else a slip: must stay as written)
    expose_eps: bool = False  # small q k^T and large input gates, where an eps shows

    def make_inputs(self):
        g = torch.Generator().manual_seed(self.seed)
        B, H, S, DK, DV, gate = (self.shapes[k] for k in ("B", "H", "S", "DK", "DV", "gate"))
        tail = (1,) if gate == 4 else ()
        views = self.shapes["views"]

        def proj(D):
            if views:  # [B, S, H, D] seen as [B, H, S, D], as a model's projections hand it over
                return torch.randn(B, S, H, D, generator=g).transpose(1, 2)
            return torch.randn(B, H, S, D, generator=g)
        ins = {"q": proj(DK), "k": proj(DK), "v": proj(DV), "i": torch.randn(B, H, S, *tail, generator=g),
               "f": torch.randn(B, H, S, *tail, generator=g) + 2}
        if self.expose_eps:
            ins["q"], ins["i"] = ins["q"] * 1e-4, ins["i"] + 20
        return [t.requires_grad_(n in self.grads and self.mode == "grad") for n, t in ins.items()]


def _shapes(rng) -> dict:
    long = rng.random() < 0.06
    B, H = (1, 1) if long else (rng.choice([1, 2]), rng.choice([1, 2, 3]))
    S = rng.choice([1024, 2048, 4096]) if long else rng.choice([1, 2, 5, 8, 17, 24, 33])
    DK, DV = (rng.choice([4, 8]), rng.choice([4, 8])) if long else (rng.choice([4, 8, 16]), rng.choice([4, 6, 8, 16]))
    return dict(B=B, H=H, S=S, DK=DK, DV=DV, gate=rng.choice([3, 4]), views=rng.random() < 0.4)


def _log_decay(rng, gate: int, apply_mask: str, no_mask: bool) -> list:
    """Lines computing logD (masked unless `no_mask`) from i, f [B, NH, S] (or, for the xlstm
    package's padded cumsum, [B, NH, S, 1])."""
    logf = rng.choice(LOG_FORGET)
    mask = (lambda x: x) if no_mask else (lambda x: apply_mask.format(x=x))
    if gate == 4 and rng.random() < 0.5:  # the xlstm package's form, on column gates
        return [f"cs = torch.cat([torch.zeros_like(f[:, :, :1]), torch.cumsum({logf}, dim=-2)], dim=-2)",
                "rep = cs.repeat(1, 1, 1, S + 1)",
                f"logD = {mask('(rep - rep.transpose(-2, -1))[:, :, 1:, 1:]')} + i.transpose(-2, -1)"]
    lines = [rng.choice(["i, f = i.squeeze(-1), f.squeeze(-1)", "i, f = i[..., 0], f[..., 0]"])] if gate == 4 else []
    lines.append(rng.choice([f"Fc = torch.cumsum({logf}, dim=-1)", f"Fc = ({logf}).cumsum(-1)"]))
    pair, row = rng.choice([("Fc[..., :, None] - Fc[..., None, :]", "i[..., None, :]"),
                            ("Fc.unsqueeze(-1) - Fc.unsqueeze(-2)", "i.unsqueeze(-2)")])
    if rng.random() < 0.5:
        lines.append(f"logD = {mask(f'{pair} + {row}')}")
    else:  # masked before adding i
        lines.append(f"logD = {mask(pair)} + {row}")
    return lines


def generate(seed: int) -> Case:
    rng = random.Random(seed)
    shapes = _shapes(rng)
    mask_line, apply_mask = MASKS[rng.choice(list(MASKS))]
    scale = rng.choice(["qk", "q", "k", "C"])
    slip = rng.choice(["root", "mask", "inner_eps"]) if rng.random() < 0.15 else None
    root = "D" if slip == "root" else "math.sqrt(D)"  # the slip: 1/D, another function
    lines = ["S, D = q.shape[-2], q.shape[-1]", mask_line]
    lines += _log_decay(rng, shapes["gate"], apply_mask, no_mask=slip == "mask")
    lines.append(rng.choice(ROW_MAX))
    einsum = rng.random() < 0.3
    kt = "k.transpose(-2, -1)"
    qk = {"qk": f"(q @ {kt}) / {root}", "q": f"(q / {root}) @ {kt}", "k": f"q @ (k / {root}).transpose(-2, -1)",
          "C": f"q @ {kt}"}[scale]
    if einsum:
        product = "torch.einsum('bhtd,bhsd->bhts', {}, {})"
        qk = {"qk": product.format("q", "k") + f" / {root}", "q": product.format(f"q / {root}", "k"),
              "k": product.format("q", f"k / {root}"), "C": product.format("q", "k")}[scale]
    decay = "torch.exp(logD - m)"
    product = f"({qk}) * {decay}" if rng.random() < 0.5 else f"{decay} * ({qk})"
    lines.append(f"C = {product} / {root}" if scale == "C" else f"C = {product}")
    rowsum, floor = "C.sum(-1, keepdim=True).abs()", "torch.exp(-m)"
    eps = rng.choice(["", " + 1e-6", " + 1e-5"])
    if slip == "inner_eps":
        rowsum, eps = rowsum + " + 1e-3", ""
    maximum = rng.choice(["torch.maximum", "torch.max"])
    args = (rowsum, floor) if rng.random() < 0.5 else (floor, rowsum)
    lines.append(f"n = {maximum}({args[0]}, {args[1]}){eps}")
    lines.append("h = torch.einsum('bhts,bhsd->bhtd', C / n, v)" if einsum else "h = (C / n) @ v")
    after = rng.choice(["", "", "h = h * 2.0", "h = torch.nn.functional.silu(h)"])
    if after:
        lines.append(after)
    src = ("import math\nimport torch\nimport torch.nn.functional as F\n\n\ndef fn(q, k, v, i, f):\n    "
           + "\n    ".join(lines) + "\n    return h\n")
    long = shapes["S"] > 64
    grads = {n for n in "qkvif" if rng.random() < 0.6}
    return Case(seed, src, shapes, grads, "no_grad" if long else rng.choice(["grad", "grad", "no_grad"]),
                rng.choice([None, False, True]), slip is None,
                # at S = 1 the gradients are zero in exact math and huge terms cancel: rounding only
                expose_eps=rng.random() < 0.25 and shapes["S"] > 1)


def _program(case: Case):
    env: dict = {}
    exec(compile(case.source, f"<mlstm fuzz case {case.seed}>", "exec"), env)
    return env["fn"]


def _run(fn, inputs, mode):
    ctx = torch.enable_grad if mode == "grad" else torch.no_grad
    with ctx():
        out = fn(*inputs)
    leaves = [t for t in inputs if t.requires_grad]
    grads = None
    if mode == "grad" and leaves:
        g = torch.Generator().manual_seed(11)
        grads = torch.autograd.grad((out * torch.randn(out.shape, generator=g)).sum(), leaves)
    return out, grads


def _err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def check(case: Case) -> str | None:
    """None when the compiled function equals eager (fp32: 2e-5 relative, norm-wise, the forms'
    own rounding) or, where it does not, is no further from the float64 truth than twice eager's
    error; and the mLSTM was replaced exactly when the form is the op's."""
    import torch_xaccel

    fn = _program(case)
    clone = lambda ts: [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]  # noqa: E731
    base = case.make_inputs()
    want, want_g = _run(fn, clone(base), case.mode)
    torch._dynamo.reset()
    got, got_g = _run(torch.compile(fn, backend="xaccel", dynamic=case.dynamic), clone(base), case.mode)
    report = torch_xaccel.last_report()
    if got.shape != want.shape or got.requires_grad != want.requires_grad:
        return f"output {tuple(got.shape)} requires_grad={got.requires_grad}, eager {tuple(want.shape)} " \
               f"requires_grad={want.requires_grad}"
    truth = None
    if _err(got, want) > 2e-5:  # long S and eps-exposing inputs: eager's own error is larger
        truth = _run(fn, [t.detach().double().requires_grad_(t.requires_grad) for t in base], case.mode)
        t = truth[0]
        if (got.double() - t).norm() > 2 * (want.double() - t).norm() + 1e-6 * t.norm():
            return f"output differs: {_err(got, want):.2e} from eager, further from the fp64 truth"
    # a gradient that is zero in exact math (at S = 1 the gates cancel and q, k only enter through
    # eps) is rounding on both sides: there the compiled one may be no further from the fp64 truth
    truth_g = truth[1] if truth else None
    for k, (g, w) in enumerate(zip(got_g or (), want_g or ())):
        if _err(g, w) <= 5e-5:
            continue
        if truth_g is None:
            t64 = [t.detach().double().requires_grad_(t.requires_grad) for t in base]
            truth_g = _run(fn, t64, case.mode)[1]
        t = truth_g[k]
        if (g.double() - t).norm() > 2 * (w.double() - t).norm() + 1e-6 * w.numel() ** 0.5:
            return f"gradient {k} differs: {_err(g, w):.2e} from eager, further from the fp64 truth"
    replaced = report.counts()["mlstm"]
    if case.exact_form and replaced != 1:
        return f"the op's form was not replaced: {report}"
    if not case.exact_form and replaced:
        return "a slip (another function) was replaced"
    return None


@dataclass
class OpCase:
    """xaccel::mlstm called directly: random shapes, chunk length, initial state, gate regime."""
    seed: int
    B: int
    H: int
    S: int
    DK: int
    DV: int
    chunk: int
    state: bool
    gate_shift: float  # input gates around this value (large ones test the stabilizers)


def generate_op(seed: int) -> OpCase:
    rng = random.Random(seed)
    return OpCase(seed, rng.choice([1, 2]), rng.choice([1, 3]), rng.choice([1, 3, 16, 31, 64, 70]),
                  rng.choice([2, 8, 16]), rng.choice([3, 8, 16]), rng.choice([8, 16, 64]), rng.random() < 0.6,
                  rng.choice([0.0, 0.0, 5.0, -5.0, 30.0]))


def check_op(case: OpCase) -> str | None:
    """The op (its chunkwise reference, through the dispatcher) against the O(S^2) defining
    formula in float64, forward and final state; its analytic backward against autograd of the
    formula, every input and initial-state gradient."""
    from torch_xaccel.ops.mlstm import reference

    g = torch.Generator().manual_seed(case.seed)
    B, H, S, DK, DV = case.B, case.H, case.S, case.DK, case.DV
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, k, v = mk(B, H, S, DK), mk(B, H, S, DK), mk(B, H, S, DV)
    i = (torch.randn(B, H, S, generator=g, dtype=torch.float64) + case.gate_shift).requires_grad_()
    f = (torch.randn(B, H, S, generator=g, dtype=torch.float64) + 2).requires_grad_()
    state = [mk(B, H, DK, DV), mk(B, H, DK), mk(B, H)] if case.state else [None, None, None]
    h, C, n, m = torch.ops.xaccel.mlstm(q, k, v, i, f, *state, 1e-6, case.chunk)
    want = reference.parallel_oracle(q, k, v, i, f, *state, eps=1e-6)
    if _err(h, want) > 1e-9:
        return f"h differs from the defining formula: {_err(h, want):.2e}"
    leaves = [q, k, v, i, f] + [t for t in state if t is not None]
    cot = torch.randn(h.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((h * cot).sum(), leaves)
    ref = torch.autograd.grad((want * cot).sum(), leaves)
    for name, a, b in zip("q k v i f C0 n0 m0".split(), got, ref):
        if _err(a, b) > 1e-8 and (a - b).abs().max() > 1e-10:
            return f"d{name} differs from autograd of the formula: {_err(a, b):.2e}"
    return None
