"""Differential fuzzing of the headwise pass: random einsum equations (letters, label orders,
ellipsis or named batch dims, the weight first or second, output orders), block sizes (some above
the kernel's, which must stay as written), slips that make the equation another function (a batch
label summed out, a weight with a batch label, the summed label kept in the output), grad or no_grad and dynamic
shapes. Each case compiled with the xaccel backend must equal eager in forward and gradients, and
be replaced exactly when it is a per-head map with blocks the kernel takes."""
from __future__ import annotations

import random
import string
from dataclasses import dataclass

import torch

from tests.helpers import rel_err
from torch_xaccel.codegen.headwise import MAX_BLOCK
from torch_xaccel.report import Report, collect

SLIPS = ("none", "sum a batch label", "batch label in the weight", "d kept in the output")


@dataclass
class Case:
    seed: int
    equation: str
    shapes: tuple
    weight_first: bool
    grad: bool
    dynamic: bool | None
    replaced: bool  # what the pass must do (_small_map)


def generate(seed: int) -> Case:
    rng = random.Random(seed)
    h, d, o, *batch = rng.sample(string.ascii_lowercase, 3 + rng.randint(0, 3))
    H, D, DO = rng.randint(1, 6), rng.choice([1, 2, 3, 4, 5, 8, 16, 24]), rng.choice([1, 3, 4, 7, 16, 20])
    sizes = {h: H, d: D, o: DO, **{b: rng.randint(1, 5) for b in batch}}
    ellipsis = rng.random() < 0.3
    x_labels = batch + [h, d]
    rng.shuffle(x_labels)
    w_labels = [h, o, d]
    rng.shuffle(w_labels)
    out_labels = batch + [h, o]
    rng.shuffle(out_labels)
    slip = rng.choices(SLIPS, weights=[6, 1, 1, 1])[0]
    if slip == "sum a batch label" and batch:
        out_labels.remove(batch[0])
    elif slip == "batch label in the weight" and batch:
        w_labels.insert(rng.randint(0, 3), batch[0])
    elif slip == "d kept in the output":
        out_labels.insert(rng.randint(0, len(out_labels)), d)  # nothing summed: not a linear map per head
    else:
        slip = "none"
    x_shape = tuple(sizes[c] for c in x_labels)
    x_spec = "".join(x_labels)
    out_spec = "".join(out_labels)
    if ellipsis:  # two extra leading dims under "..."
        x_spec, out_spec, x_shape = "..." + x_spec, "..." + out_spec, (2, 3) + x_shape
    w_shape = tuple(sizes[c] for c in w_labels)
    weight_first = rng.random() < 0.3
    specs = (("".join(w_labels), x_spec) if weight_first else (x_spec, "".join(w_labels)))
    equation = f"{specs[0]},{specs[1]}->{out_spec}"
    return Case(seed, equation, (w_shape, x_shape) if weight_first else (x_shape, w_shape), weight_first,
                rng.random() < 0.6, rng.choice([None, False, True]),
                _small_map(equation, (w_shape, x_shape) if weight_first else (x_shape, w_shape)))


def _small_map(equation: str, shapes: tuple) -> bool:
    """Whether either operand reads as the weight of a per-head map (three labels: the head in
    both operands and the output, one summed, one only in it and the output; x's other labels all
    in the output) with blocks the kernel takes: the pass must then replace the einsum."""
    lhs, out = equation.split("->")
    specs = lhs.split(",")
    for wi in (0, 1):
        w, x = specs[wi], specs[1 - wi].replace("...", "")
        o_labels = out.replace("...", "")
        if "..." in w or len(w) != 3 or any(len(set(t)) != len(t) for t in (w, x, o_labels)):
            continue
        heads, summed = set(w) & set(x) & set(o_labels), (set(w) & set(x)) - set(o_labels)
        outs, batch = (set(w) & set(o_labels)) - set(x), set(x) - set(w)
        if len(heads) == len(summed) == len(outs) == 1 and set(o_labels) == batch | heads | outs:
            D, DO = shapes[wi][w.index(summed.pop())], shapes[wi][w.index(outs.pop())]
            if D <= MAX_BLOCK and DO <= MAX_BLOCK:
                return True
    return False


def _run(fn, inputs, grad: bool):
    if not grad:
        with torch.no_grad():
            return fn(*inputs), []
    out = fn(*inputs)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return out.detach(), list(torch.autograd.grad((out * cot).sum(), inputs))


def check(case: Case) -> str | None:
    gen = torch.Generator().manual_seed(case.seed)
    inputs = [torch.randn(s, generator=gen).requires_grad_(case.grad) for s in case.shapes]

    def fn(a, b):
        return torch.einsum(case.equation, a, b) * 1.5

    want, want_g = _run(fn, inputs, case.grad)
    torch._dynamo.reset()
    with collect() as graphs:
        got, got_g = _run(torch.compile(fn, backend="xaccel", dynamic=case.dynamic), inputs, case.grad)
    if got.shape != want.shape or rel_err(got, want) > 1e-5:
        return f"forward differs ({rel_err(got, want):.1e})"
    if any(rel_err(g, w) > 1e-5 for g, w in zip(got_g, want_g)):
        return "gradients differ"
    n = Report(graphs=graphs).counts()["headwise"]
    if (n == 1) != case.replaced:
        return f"replaced {n} time(s), expected {'1' if case.replaced else '0'}"
    return None
