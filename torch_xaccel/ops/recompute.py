"""Gradients by recomputation, for ops whose backward reruns their reference under autograd."""
from __future__ import annotations

import torch


def recompute_grads(fn, inputs: list, output_grads: list) -> list:
    """Gradients of fn's outputs (weighted by output_grads; None skips one) with respect to every
    floating-point input, by re-running fn on detached inputs under autograd. Only valid where
    autograd records: in an autograd formula, not inside a custom op's body."""
    leaves = [t.detach().requires_grad_(True) if t is not None and t.is_floating_point() else None for t in inputs]
    with torch.enable_grad():
        outs = fn(*leaves)
    pairs = [(o, g) for o, g in zip(outs, output_grads) if g is not None and o.requires_grad]
    wanted = [t for t in leaves if t is not None]
    if not pairs:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
    return [next(got) if t is not None else None for t in leaves]
