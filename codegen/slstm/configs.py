"""The sLSTM cluster kernels' configurations: how a head's units split over the CTAs of one
thread-block cluster (C), how the CTA's warps share its slice of R, and how deep the input ring is.

A CTA owns U = D / C units (all four gates): its R slice is [4U, D], kept as MMA B fragments
(4U / 8 n-tiles x D / 16 k-steps, two 32-bit registers each). Its NW warps form KSPLIT groups
along D (shorter dependent MMA chains, partial sums added in shared memory) of NW / KSPLIT warps
along the outputs. A configuration fits when each thread holds at most MAX_R_REGISTERS of R and
the static shared memory (h double buffer, partial sums, input ring) stays within 48 KB."""
from __future__ import annotations

import torch

DTYPES = (torch.bfloat16, torch.float16)
BT = 16  # batch rows per cluster: one MMA row tile
CLUSTER_SIZES = (1, 2, 4, 8)  # portable cluster sizes
KSPLITS = (1, 2)
MAX_WARPS = 16
MAX_R_REGISTERS = 96
STATIC_SHARED = 48 * 1024
RING_WORDS = {"fwd": 4, "bwd": 15}  # 32-bit words per slot and step each kernel streams in


def _slots_per_thread(U: int, NW: int) -> int:
    return -(-(BT * U // 2) // (NW * 32))


def shared_bytes(D: int, U: int, NW: int, KSPLIT: int, STAGES: int, kernel: str = "fwd") -> int:
    h_buffers = 2 * BT * (D + 8) * 2
    partials = KSPLIT * BT * (4 * U + 4) * 4
    ring = STAGES * RING_WORDS[kernel] * _slots_per_thread(U, NW) * NW * 32 * 4
    return h_buffers + partials + ring


def _configs(D: int, C: int, KSPLIT: int) -> list[dict]:
    """Up to two warp layouts for (C, KSPLIT): the fewest warps whose R share fits the registers,
    and eight or more warps along the outputs when that divides (more threads for the pointwise)."""
    if D % C or D % 16:
        return []
    U = D // C
    if (4 * U) % 8 or (D // 16) % KSPLIT:
        return []
    n_tiles, k_steps = 4 * U // 8, D // 16 // KSPLIT
    fits = [nwn for nwn in (1, 2, 4, 8, 16) if n_tiles % nwn == 0 and 4 <= nwn * KSPLIT <= MAX_WARPS
            and k_steps * (n_tiles // nwn) * 2 <= MAX_R_REGISTERS]
    picked = sorted({fits[0], *[nwn for nwn in fits if nwn * KSPLIT >= 8][:1]}) if fits else []
    out = []
    for nwn in picked:
        NW = nwn * KSPLIT
        stages = next((s for s in (8, 6, 4, 3, 2) if shared_bytes(D, U, NW, KSPLIT, s) <= STATIC_SHARED), None)
        if stages:
            out.append({"C": C, "U": U, "NW": NW, "NTW": n_tiles // nwn, "KSPLIT": KSPLIT, "STAGES": stages})
    return out


def candidates(D: int) -> list[dict]:
    """Every configuration that fits a head of D units, fewest CTAs per cluster first."""
    return [cfg for C in CLUSTER_SIZES for k in KSPLITS for cfg in _configs(D, C, k)]


def default(D: int) -> dict | None:
    """The untimed choice: the largest cluster (the least MMA work per CTA and step, which is the
    step's critical path next to the exchange), its shorter MMA chains."""
    cands = candidates(D)
    if not cands:
        return None
    largest = max(c["C"] for c in cands)
    return max((c for c in cands if c["C"] == largest), key=lambda c: (c["KSPLIT"], c["NW"]))


# ---- the backward kernel ------------------------------------------------------------------------
# A CTA holds R[head, :, its U units, :] ([4U, D]: D / 8 n-tiles x 4U / 16 k-steps), split over its NW
# warps along D (NTW n-tiles each); its dynamic shared memory holds the double-buffered shares of dh
# [2, C, BT, U] (bf16 for bf16 inputs, else fp32: the template says why), the double-buffered staged
# gate gradients [2, BT, 4U + 8] and the input ring.
MAX_DYNAMIC_SHARED = 200 * 1024
BACKWARD_WARPS = (4, 8, 12, 16)


def share_bytes(dtype: torch.dtype) -> int:
    """Bytes per exchanged share of dh in the backward: bf16 for bf16 (fp32's exponent range), fp32
    otherwise (fp16 would overflow at 65504)."""
    return 2 if dtype == torch.bfloat16 else 4


def backward_shared_bytes(D: int, U: int, NW: int, STAGES: int, share: int = 4) -> int:
    """share: bytes per exchanged share of dh (the candidates are sized for the larger, 4)."""
    return 2 * BT * D * share + 2 * BT * (4 * U + 8) * 2 + \
        STAGES * RING_WORDS["bwd"] * _slots_per_thread(U, NW) * NW * 32 * 4


def backward_candidates(D: int) -> list[dict]:
    out = []
    for C in CLUSTER_SIZES:
        if D % C or (D // C) % 8:
            continue
        U, k_steps, n_tiles = D // C, 4 * (D // C) // 16, D // 8
        for NW in BACKWARD_WARPS:
            if n_tiles % NW or (n_tiles // NW) * k_steps * 2 > MAX_R_REGISTERS:
                continue
            stages = next((s for s in (6, 4, 3, 2) if backward_shared_bytes(D, U, NW, s) <= MAX_DYNAMIC_SHARED), None)
            if stages:
                out.append({"C": C, "U": U, "NW": NW, "NTW": n_tiles // NW, "STAGES": stages})
    return out


def backward_default(D: int) -> dict | None:
    """The largest cluster, eight warps where possible (the forward's measured preference)."""
    cands = backward_candidates(D)
    if not cands:
        return None
    largest = max(c["C"] for c in cands)
    return min((c for c in cands if c["C"] == largest), key=lambda c: abs(c["NW"] - 8))
