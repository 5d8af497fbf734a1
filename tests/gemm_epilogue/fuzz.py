"""A seeded generator of random GEMM + elementwise programs and the code around them, and their
differential check against eager (tests/gemm_epilogue/test_fuzz.py runs it).

Each case is a small Python function written out as source, so that a failing case prints a
standalone reproducer. It mixes what the gemm_epilogue pass matches (a GEMM form, then a chain of
unary and binary ops whose other operand is a number or a full/row/col/scalar tensor, dual GEMMs)
with what must stay correct around it: values the graph also reads mid-chain, ops the epilogue
does not take (a cast, exp, a view), transposes and slices of inputs, in-place writes to inputs,
their views and intermediates before and after their use, Python bools, requires_grad on some
inputs, grad / no_grad / inference_mode, dynamic shapes, and a second call at another batch size.
"""
from __future__ import annotations

import random
import textwrap
from dataclasses import dataclass

import torch

UNARY = ["torch.relu({})", "torch.nn.functional.gelu({})", "torch.nn.functional.gelu({}, approximate='tanh')",
         "torch.nn.functional.silu({})", "torch.sigmoid({})", "torch.tanh({})"]
BINARY = ["+", "-", "*", "/"]
OUTSIDE = ["torch.exp({}.clamp(max=4))", "{}.float().to({dtype})", "{}.contiguous().view({shape})",
           "{}.transpose(-1, -2).transpose(-1, -2)", "torch.nn.functional.softplus({})"]


@dataclass
class Case:
    seed: int
    source: str
    inputs: list[tuple[str, tuple, bool]]  # (name, shape, requires_grad)
    dtype: torch.dtype
    mode: str  # "grad", "no_grad" or "inference_mode"
    dynamic: bool | None
    second_m: int | None  # a second call with this M (shapes change between calls)
    m: int = 4
    other_dtypes: dict | None = None  # input name -> a dtype other than the case's (mixed dtypes)

    def make_inputs(self, m: int | None = None, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 7919 + (m or 0))
        out = []
        for name, shape, grad in self.inputs:
            shape = tuple(m if s == "M" else s for s in shape) if m else tuple(self.m if s == "M" else s
                                                                              for s in shape)
            t = torch.randn(shape, generator=g, dtype=torch.float64)
            if name.startswith("d"):  # divisors: away from zero
                t = t.sign() * (0.5 + t.abs())
            t = t.to(dtype or (self.other_dtypes or {}).get(name, self.dtype))
            out.append(t.requires_grad_(grad and self.mode == "grad"))
        return out

    def reproducer(self) -> str:
        shapes = ", ".join(f"{n}={s}" for n, s, _ in self.inputs)
        return textwrap.dedent(f"""\
            # xaccel fuzz case, seed {self.seed}: {self.dtype}, mode {self.mode}, dynamic={self.dynamic},
            # second call at M={self.second_m}; inputs {shapes} (requires_grad: {[n for n, _, g in self.inputs if g]},
            # other dtypes: {self.other_dtypes})
            import torch
            {self.source}
            from tests.gemm_epilogue.fuzz import generate
            case = generate({self.seed})
            from tests.gemm_epilogue.fuzz import check
            print(check(case))
            """)


def _operand(rng: random.Random, inputs: list, lead: tuple, n: int, kind: str | None = None) -> str:
    """A tensor or number the chain combines with: its name or literal."""
    kind = kind or rng.choice(["row", "full", "col", "scalar", "number", "number", "int", "full_view",
                               "full_slice"])
    idx = len(inputs)
    if kind == "number":
        return repr(round(rng.uniform(-2, 2), 3))
    if kind == "int":
        return str(rng.choice([-2, -1, 1, 2, 3]))
    shape = {"row": (n,), "full": (*lead, "M", n), "col": (*lead, "M", 1), "scalar": ()}.get(kind)
    if kind == "full_view":  # a transposed view of a [N, M] input
        inputs.append((f"t{idx}", (*lead, n, "M"), rng.random() < 0.3))
        return f"t{idx}.transpose(-1, -2)"
    if kind == "full_slice":  # the first n columns of a wider input
        inputs.append((f"s{idx}", (*lead, "M", n + 3), rng.random() < 0.3))
        return f"s{idx}[..., :{n}]"
    inputs.append((f"o{idx}", shape, rng.random() < 0.3))
    return f"o{idx}"


def generate(seed: int) -> Case:
    rng = random.Random(seed)
    dtype = rng.choices([torch.float32, torch.float16, torch.bfloat16], [6, 1, 1])[0]
    mode = rng.choices(["grad", "no_grad", "inference_mode"], [3, 1, 1])[0]
    dynamic = rng.choice([None, False, True])
    lead = rng.choice([(), (), (2,)])
    K, N = rng.choice([4, 8, 16]), rng.choice([4, 8, 12])
    inputs: list = [("x", (*lead, "M", K), rng.random() < 0.5)]
    body: list[str] = []
    outputs: list[str] = []
    # the GEMM
    w_layout = rng.choice(["nk", "kn"])
    inputs.append(("w", (N, K) if w_layout == "nk" else (K, N), rng.random() < 0.5))
    wt = "w.t()" if w_layout == "nk" else "w"
    forms = [f"x @ {wt}", f"torch.matmul(x, {wt})"]
    if w_layout == "nk":
        forms.append("torch.nn.functional.linear(x, w)")
        if rng.random() < 0.5:
            inputs.append(("b", (N,), rng.random() < 0.5))
            forms.append("torch.nn.functional.linear(x, w, b)")
    if not lead:
        forms.append(f"torch.mm(x, {wt})")
    gemm = rng.choice(forms)
    dual = rng.random() < 0.15
    if dual:
        inputs.append(("w2", inputs[1][1], rng.random() < 0.5))
        w2t = "w2.t()" if w_layout == "nk" else "w2"
        body.append(f"h = torch.nn.functional.silu({gemm}) * (x @ {w2t})")
    else:
        body.append(f"h = {gemm}")
    writes = rng.random() < 0.25
    if writes and rng.random() < 0.5:  # write an input (or a view of it) before the chain reads it
        body.insert(0, rng.choice(["x.mul_(1.5)" if mode != "grad" else "pass", "pass"]))
    aliased = mode != "grad" and rng.random() < 0.2
    if aliased:  # a view of an operand taken before its base is written, read after the write
        base = _operand(rng, inputs, lead, N, rng.choice(["row", "full", "col"]))
        body.append(f"v = {base}.view({base}.shape)")
    steps = rng.randint(1, 5)
    for s in range(steps):
        r = rng.random()
        if aliased and s == steps // 2:
            body += [f"{base}.mul_(2)", "h = h + v"]
        elif r < 0.3:
            body.append(f"h = {rng.choice(UNARY).format('h')}")
        elif r < 0.7:
            op = rng.choice(BINARY)
            other = _operand(rng, inputs, lead, N) if op != "/" else _divisor(rng, inputs, lead, N)
            if rng.random() < 0.3 and op in "+*":
                body.append(f"h = {other} {op} h")
            else:
                body.append(f"h = h {op} {other}")
        elif r < 0.9:
            outputs.append(f"h{s}")
            body.append(f"h{s} = h")  # an intermediate the graph also returns
        else:
            shape = "h.shape"
            body.append(f"h = {rng.choice(OUTSIDE).format('h', dtype='h.dtype', shape=shape)}")
    if rng.random() < 0.05:
        body.append("h = h - True")  # eager raises for a bool operand here
    if writes:  # in-place writes to an operand or its view, or to an intermediate, after the chain
        targets = [n for n, _, _ in inputs if n.startswith("o")]
        choice = rng.random()
        if targets and choice < 0.5 and mode != "grad":
            tgt = rng.choice(targets)
            body.insert(rng.randint(1, len(body)), f"{tgt}.view(-1).mul_(2)" if rng.random() < 0.5
                        else f"{tgt}.mul_(2)")
        elif choice < 0.8 and mode != "grad":
            body.append("h.add_(1)")
    outputs.insert(0, "h")
    src = "def fn({}):\n    {}\n    return {}\n".format(
        ", ".join(n for n, _, _ in inputs), "\n    ".join(body), ", ".join(outputs))
    others = [n for n, _, _ in inputs if n[0] in "oda"]
    mixed = {n: rng.choice([torch.float32, torch.float64, torch.float16]) for n in others if rng.random() < 0.08}
    return Case(seed, src, inputs, dtype, mode, dynamic, rng.choice([None, None, 3, 6]), rng.choice([1, 3, 5, 8]),
                {n: d for n, d in mixed.items() if d != dtype})


def _divisor(rng, inputs, lead, n) -> str:
    kind = rng.choice(["row", "full", "col", "number"])
    if kind == "number":
        return repr(rng.choice([-2.5, -0.75, 0.5, 1.25, 3.0]))
    idx = len(inputs)
    shape = {"row": (n,), "full": (*lead, "M", n), "col": (*lead, "M", 1)}[kind]
    inputs.append((f"d{idx}", shape, rng.random() < 0.3))
    return f"d{idx}"


def _program(case: Case):
    env: dict = {"torch": torch}
    exec(compile(case.source, f"<fuzz case {case.seed}>", "exec"), env)
    return env["fn"]


def _run(fn, inputs, mode):
    """(outputs or the exception, the inputs after the call, gradients of the leaves)."""
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    try:
        with ctx():
            outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
    except Exception as e:  # noqa: BLE001 - an error is a result to compare
        return e, inputs, None
    grads = None
    leaves = [t for t in inputs if t.requires_grad]
    diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    if mode == "grad" and leaves and diff:
        g = torch.Generator().manual_seed(5)
        loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in diff)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return outs, inputs, grads


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return float("inf")
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return float("inf")
    a, b = a[torch.isfinite(b)], b[torch.isfinite(b)]
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item() if b.numel() else 0.0


def check(case: Case, backend: str = "xaccel") -> str | None:
    """None when the compiled program agrees with eager on every call, else what differs."""
    fn = _program(case)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, dynamic=case.dynamic)
    for m in [None] + ([case.second_m] if case.second_m else []):
        why = _compare(case, fn, compiled, m)
        if why:
            return f"M={m or case.m}: {why}"
    return None


def _compare(case: Case, fn, compiled, m) -> str | None:
    base = case.make_inputs(m)
    clone = lambda ts: [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]  # noqa: E731
    want, want_in, want_g = _run(fn, clone(base), case.mode)
    got, got_in, got_g = _run(compiled, clone(base), case.mode)
    if isinstance(want, Exception) or isinstance(got, Exception):
        if not (isinstance(want, Exception) and isinstance(got, type(want))):  # Dynamo may subclass eager's
            def what(r):
                return type(r).__name__ if isinstance(r, Exception) else "ran"
            error = got if isinstance(got, Exception) else want
            return f"eager {what(want)}, compiled {what(got)}: {error}"
        return None
    if len(want) != len(got):
        return f"{len(got)} outputs, eager {len(want)}"
    low = case.dtype != torch.float32
    truth = None
    if low:  # the fp64 truth: the same program on fp64 copies of the inputs
        t64 = [t.detach().double().requires_grad_(t.requires_grad) for t in base]
        truth, truth_in, truth_g = _run(fn, t64, case.mode)
    for k, (w, g) in enumerate(zip(want, got)):
        if w.dtype != g.dtype or w.shape != g.shape:
            return f"output {k}: {g.dtype} {tuple(g.shape)}, eager {w.dtype} {tuple(w.shape)}"
        if w.requires_grad != g.requires_grad:
            return f"output {k}: requires_grad {g.requires_grad}, eager {w.requires_grad}"
        if not _close(g, w, truth[k] if low else None):
            return f"output {k} differs: {_err(g, w):.2e} from eager"
    for k, (w, g) in enumerate(zip(want_in, got_in)):
        if not _close(g.detach(), w.detach(), truth_in[k].detach() if low else None):
            return f"input {k} after the call differs ({_err(g.detach(), w.detach()):.2e}): an in-place write"
    if (want_g is None) != (got_g is None):
        return "gradients on one side only"
    for k, (w, g) in enumerate(zip(want_g or (), got_g or ())):
        if (w is None) != (g is None):
            return f"gradient {k}: None on one side"
        if w is not None and not _close(g, w, truth_g[k] if low and truth_g else None, grad=True):
            return f"gradient {k} differs: {_err(g, w):.2e} from eager"
    return None


def _close(got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor | None, grad: bool = False) -> bool:
    """fp32: within 1e-5 of eager (norm-wise). fp16/bf16: no further from the fp64 truth than
    eager's result is, give or take two units in the last place (on a handful of elements either
    side's roundings can be lucky)."""
    if truth is None:
        return _err(got, want) <= (2e-5 if grad else 1e-5)
    e_got, e_want = _err(got, truth), _err(want, truth)
    return e_got <= 1.5 * e_want + (2 ** -7 if want.dtype == torch.bfloat16 else 2 ** -9)
