"""The sLSTM sequence kernels' configurations: how a head's units split over C CTAs, how the CTAs
exchange h (`exchange`), how each CTA's warps share its slice of R, and how deep the input ring is.

Two exchanges: "cluster" (the C CTAs of a head form one thread-block cluster, sm_90: h goes
through distributed shared memory) and "global" (the C CTAs form a group of a cooperative grid:
h goes through L2 as flagged words; heads wider than one cluster holds, and GPUs
without clusters). A global configuration also needs every CTA of the launch resident at once,
one per SM: `max_group` bounds C by the SMs over the launch's groups.

A CTA owns U = D / C units (all four gates): its R slice is [4U, D], kept as MMA B fragments
(4U / 8 n-tiles x D / 16 k-steps, two 32-bit registers each, four in fp32). Its NW warps form
KSPLIT groups along D (shorter dependent MMA chains, partial sums added in shared memory) of
NW / KSPLIT warps along the outputs. A configuration fits when each thread holds at most
MAX_R_REGISTERS of R and the shared memory stays within its limit (16-bit cluster kernels: static,
h double buffer + partial sums + input ring within 48 KB; fp32 and global kernels: dynamic; the
global exchange keeps one h buffer). `itemsize` is the inputs' element size: 2 (bf16, fp16) or 4
(fp32, whose h, Wx ring and staged gradients are twice as large)."""
from __future__ import annotations

import torch

# The dtypes the templates render kernels for (fp32 as 3xTF32 products) and the runtime runs.
ENABLED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BT = 16  # batch rows per cluster: one MMA row tile
CLUSTER_SIZES = (1, 2, 4, 8)  # portable cluster sizes
GROUP_SIZES = (4, 8, 12, 16, 24, 32, 48, 64, 96)  # CTAs per head in the global exchange
KSPLITS = {"cluster": (1, 2), "global": (1, 2, 4)}
MAX_WARPS = 16
MAX_R_REGISTERS = 96
STATIC_SHARED = 48 * 1024
MAX_DYNAMIC_SHARED = 200 * 1024
RING_WORDS = {("fwd", 2): 4, ("bwd", 2): 15,  # 32-bit words per slot and step each kernel streams in
              ("fwd", 4): 8, ("bwd", 4): 16}


def _slots_per_thread(U: int, NW: int) -> int:
    return -(-(BT * U // 2) // (NW * 32))


def _h_row(D: int, itemsize: int) -> int:
    """Elements per padded row of the forward's h buffer (the templates' HP)."""
    return D + (8 if itemsize == 2 else 4)


def _ring_bytes(kernel: str, U: int, NW: int, STAGES: int, itemsize: int) -> int:
    return STAGES * RING_WORDS[(kernel, itemsize)] * _slots_per_thread(U, NW) * NW * 32 * 4


def shared_bytes(D: int, U: int, NW: int, KSPLIT: int, STAGES: int, kernel: str = "fwd",
                 exchange: str = "cluster", itemsize: int = 2) -> int:
    h_buffers = (2 if exchange == "cluster" else 1) * BT * _h_row(D, itemsize) * itemsize
    partials = KSPLIT * BT * (4 * U + 4) * 4
    return h_buffers + partials + _ring_bytes(kernel, U, NW, STAGES, itemsize)


def _dynamic(exchange: str, itemsize: int) -> bool:
    """Whether the forward's shared memory is dynamic (the templates' `dynamic`)."""
    return exchange == "global" or itemsize == 4


def _configs(D: int, C: int, KSPLIT: int, exchange: str, itemsize: int) -> list[dict]:
    """Up to two warp layouts for (C, KSPLIT): the fewest warps whose R share fits the registers,
    and eight or more warps along the outputs when that divides (more threads for the pointwise)."""
    if D % C or D % 16:
        return []
    U = D // C
    if (4 * U) % 8 or (D // 16) % KSPLIT:
        return []
    n_tiles, k_steps = 4 * U // 8, D // 16 // KSPLIT
    fits = [nwn for nwn in (1, 2, 4, 8, 16) if n_tiles % nwn == 0 and 4 <= nwn * KSPLIT <= MAX_WARPS
            and k_steps * (n_tiles // nwn) * itemsize <= MAX_R_REGISTERS]
    picked = sorted({fits[0], *[nwn for nwn in fits if nwn * KSPLIT >= 8][:1]}) if fits else []
    limit = MAX_DYNAMIC_SHARED if _dynamic(exchange, itemsize) else STATIC_SHARED
    out = []
    for nwn in picked:
        NW = nwn * KSPLIT
        stages = next((s for s in (8, 6, 4, 3, 2)
                       if shared_bytes(D, U, NW, KSPLIT, s, "fwd", exchange, itemsize) <= limit), None)
        if stages:
            out.append({"C": C, "U": U, "NW": NW, "NTW": n_tiles // nwn, "KSPLIT": KSPLIT, "STAGES": stages,
                        "exchange": exchange})
    return out


def _sizes(exchange: str, max_group: int | None) -> tuple[int, ...]:
    sizes = CLUSTER_SIZES if exchange == "cluster" else GROUP_SIZES
    return tuple(C for C in sizes if max_group is None or C <= max_group)


def candidates(D: int, exchange: str = "cluster", max_group: int | None = None, itemsize: int = 2) -> list[dict]:
    """Every configuration that fits a head of D units, fewest CTAs per head first; for the global
    exchange one per group size (the shortest MMA chains, the most warps), which keeps tuning short."""
    per_size = [[cfg for k in KSPLITS[exchange] for cfg in _configs(D, C, k, exchange, itemsize)]
                for C in _sizes(exchange, max_group)]
    if exchange == "global":
        return [max(cfgs, key=lambda c: (c["KSPLIT"], c["NW"])) for cfgs in per_size if cfgs]
    return [cfg for cfgs in per_size for cfg in cfgs]


def default(D: int, exchange: str = "cluster", max_group: int | None = None, itemsize: int = 2) -> dict | None:
    """The untimed choice: the most CTAs per head (the least MMA work per CTA and step, which is the
    step's critical path next to the exchange), their shorter MMA chains."""
    cands = candidates(D, exchange, max_group, itemsize)
    if not cands:
        return None
    largest = max(c["C"] for c in cands)
    return max((c for c in cands if c["C"] == largest), key=lambda c: (c["KSPLIT"], c["NW"]))


def forward_shared_bytes(D: int, cfg: dict, itemsize: int = 2) -> int:
    """The dynamic shared memory a forward launch asks for (the 16-bit cluster kernel's is static)."""
    if not _dynamic(cfg["exchange"], itemsize):
        return 0
    return shared_bytes(D, cfg["U"], cfg["NW"], cfg["KSPLIT"], cfg["STAGES"], "fwd", cfg["exchange"], itemsize)


# ---- the backward kernel ------------------------------------------------------------------------
# A CTA holds R[head, :, its U units, :] ([4U, D]: D / 8 n-tiles x 4U / 16 k-steps), split over its NW
# warps along D (NTW n-tiles each); its dynamic shared memory holds the double-buffered shares of dh
# [2, C, BT, U] (bf16 for bf16 inputs, else fp32: the template says why), the double-buffered staged
# gate gradients [2, BT, 4U + 8] (16-bit; fp32: [2, BT, 4U + 4]) and the input ring.
BACKWARD_WARPS = (4, 8, 12, 16)


def share_bytes(dtype: torch.dtype) -> int:
    """Bytes per exchanged share of dh in the backward: bf16 for bf16 (fp32's exponent range), fp32
    otherwise (fp16 would overflow at 65504)."""
    return 2 if dtype == torch.bfloat16 else 4


def backward_shared_bytes(D: int, U: int, NW: int, STAGES: int, share: int = 4, itemsize: int = 2) -> int:
    """share: bytes per exchanged share of dh (the candidates are sized for the larger, 4)."""
    staged = 2 * BT * (4 * U + (8 if itemsize == 2 else 4)) * itemsize
    return 2 * BT * D * share + staged + _ring_bytes("bwd", U, NW, STAGES, itemsize)


def backward_candidates(D: int, exchange: str = "cluster", max_group: int | None = None,
                        itemsize: int = 2) -> list[dict]:
    out = []
    for C in _sizes(exchange, max_group):
        if D % C or (D // C) % 8:
            continue
        U, k_steps, n_tiles = D // C, 4 * (D // C) // 16, D // 8
        for NW in BACKWARD_WARPS:
            if n_tiles % NW or (n_tiles // NW) * k_steps * itemsize > MAX_R_REGISTERS:
                continue
            stages = next((s for s in (6, 4, 3, 2)
                           if backward_shared_bytes(D, U, NW, s, itemsize=itemsize) <= MAX_DYNAMIC_SHARED), None)
            if stages:
                out.append({"C": C, "U": U, "NW": NW, "NTW": n_tiles // NW, "STAGES": stages, "exchange": exchange})
    return out


def backward_default(D: int, exchange: str = "cluster", max_group: int | None = None,
                     itemsize: int = 2) -> dict | None:
    """The most CTAs per head, eight warps where possible (the forward's measured preference)."""
    cands = backward_candidates(D, exchange, max_group, itemsize)
    if not cands:
        return None
    largest = max(c["C"] for c in cands)
    return min((c for c in cands if c["C"] == largest), key=lambda c: abs(c["NW"] - 8))
