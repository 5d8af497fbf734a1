"""A seeded generator of the stabilized parallel mLSTM written in random styles, and its differential
check against eager (tests/mlstm/test_fuzz.py runs it).

Each case writes the formula with a random causal mask (masked_fill of ~tril or triu, where of
tril), the 1/sqrt(DQK) scale on q k^T, q or k, gates [B, NH, S] or [B, NH, S, 1], the commutative
ops' arguments in either order, the projections as transposed views or contiguous, random S
(odd ones included) and head dims, requires_grad on some inputs, grad or no_grad, dynamic
shapes or not; sometimes with a slip that makes it another function (a wrong scale, a missing
mask), which must not be replaced and must still equal eager."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

MASKS = {
    "masked_fill_tril": ("mask = torch.tril(torch.ones(S, S, dtype=torch.bool, device=q.device))",
                         "({x}).masked_fill(~mask, float('-inf'))"),
    "masked_fill_triu": ("mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=q.device), diagonal=1)",
                         "({x}).masked_fill(mask, -math.inf)"),
    "where_tril": ("mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()",
                   "torch.where(mask, {x}, float('-inf'))"),
}


@dataclass
class Case:
    seed: int
    source: str
    shapes: dict
    grads: set
    mode: str
    dynamic: bool | None
    exact_form: bool  # the formula as the op defines it (else a slip: must stay as written)

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
        return [t.requires_grad_(n in self.grads and self.mode == "grad") for n, t in ins.items()]


def generate(seed: int) -> Case:
    rng = random.Random(seed)
    B, H = rng.choice([1, 2]), rng.choice([1, 2, 3])
    S, DK, DV = rng.choice([1, 2, 5, 8, 17, 24, 33]), rng.choice([4, 8, 16]), rng.choice([4, 6, 8, 16])
    gate = rng.choice([3, 4])
    mask_line, apply_mask = MASKS[rng.choice(list(MASKS))]
    scale = rng.choice(["qk", "q", "k"])
    slip = rng.random() < 0.15
    root = "math.sqrt(D)" if not slip or rng.random() < 0.5 else "D"  # the slip: 1/D, another function
    lines = ["S, D = q.shape[-2], q.shape[-1]"]
    if gate == 4:
        lines += [rng.choice(["i, f = i.squeeze(-1), f.squeeze(-1)", "i, f = i[..., 0], f[..., 0]"])]
    lines.append(rng.choice(["Fc = torch.cumsum(F.logsigmoid(f), dim=-1)", "Fc = F.logsigmoid(f).cumsum(-1)"]))
    lines.append(mask_line)
    diff = rng.choice(["Fc[..., :, None] - Fc[..., None, :] + i[..., None, :]",
                       "Fc.unsqueeze(-1) - Fc.unsqueeze(-2) + i.unsqueeze(-2)"])
    if slip and root == "math.sqrt(D)":  # the other slip: no mask at all
        lines.append(f"logD = {diff}")
    else:
        lines.append(f"logD = {apply_mask.format(x=diff)}")
    lines.append(rng.choice(["m = logD.amax(dim=-1, keepdim=True)", "m = torch.amax(logD, -1, keepdim=True)"]))
    qk = {"qk": f"(q @ k.transpose(-2, -1)) / {root}", "q": f"(q / {root}) @ k.transpose(-1, -2)",
          "k": f"q @ (k / {root}).transpose(-2, -1)"}[scale]
    decay = "torch.exp(logD - m)"
    lines.append(f"C = ({qk}) * {decay}" if rng.random() < 0.5 else f"C = {decay} * ({qk})")
    rowsum, floor = "C.sum(-1, keepdim=True).abs()", "torch.exp(-m)"
    lines.append(f"n = torch.maximum({rowsum}, {floor})" if rng.random() < 0.5 else
                 f"n = torch.maximum({floor}, {rowsum})")
    lines.append("h = (C / (n + 1e-6)) @ v")
    after = rng.choice(["", "", "h = h * 2.0", "h = torch.nn.functional.silu(h)"])
    if after:
        lines.append(after)
    src = ("import math\nimport torch\nimport torch.nn.functional as F\n\n\ndef fn(q, k, v, i, f):\n    "
           + "\n    ".join(lines) + "\n    return h\n")
    grads = {n for n in "qkvif" if rng.random() < 0.6}
    return Case(seed, src, dict(B=B, H=H, S=S, DK=DK, DV=DV, gate=gate, views=rng.random() < 0.4), grads,
                rng.choice(["grad", "grad", "no_grad"]), rng.choice([None, False, True]), not slip)


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
    own rounding), the mLSTM was replaced exactly when the form is the op's, and the report
    names the step where a slip made it another function."""
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
    if _err(got, want) > 2e-5:
        return f"output differs: {_err(got, want):.2e}"
    # a gradient that is zero in exact math (at S = 1 the gates cancel and q, k only enter through
    # eps) is rounding on both sides: there the compiled one may be no further from the fp64 truth
    truth_g = None
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
