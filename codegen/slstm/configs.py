"""The sLSTM cluster kernel's configurations: how a head's units split over the CTAs of one
thread-block cluster (C), and how many warps hold that CTA's slice of R in registers.

A CTA owns U = D / C units (all four gates): its R slice is [4U, D], kept as MMA B fragments
(4U / 8 n-tiles x D / 16 k-steps, two 32-bit registers each, spread over the warps). A
configuration fits when each thread holds at most MAX_R_REGISTERS of them."""
from __future__ import annotations

import torch

DTYPES = (torch.bfloat16, torch.float16)
BT = 16  # batch rows per cluster: one MMA row tile
CLUSTER_SIZES = (1, 2, 4, 8)  # portable cluster sizes
WARPS = (4, 8, 16)
MAX_R_REGISTERS = 96


def _config(D: int, C: int) -> dict | None:
    if D % C or D % 16:
        return None
    U = D // C
    if (4 * U) % 8:
        return None
    n_tiles, k_steps = 4 * U // 8, D // 16
    for warps in WARPS:
        if n_tiles % warps == 0 and k_steps * (n_tiles // warps) * 2 <= MAX_R_REGISTERS:
            return {"C": C, "U": U, "NW": warps, "NTW": n_tiles // warps}
    return None


def candidates(D: int) -> list[dict]:
    """Every configuration that fits a head of D units, fewest CTAs per cluster first."""
    return [cfg for C in CLUSTER_SIZES if (cfg := _config(D, C)) is not None]


def default(D: int) -> dict | None:
    """The untimed choice: the largest cluster (the least MMA work per CTA and step, which is the
    step's critical path next to the exchange)."""
    cands = candidates(D)
    return cands[-1] if cands else None
