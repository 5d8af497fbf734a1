"""Generated Triton kernels for xaccel::pointwise: the program's ops as straight-line fp32 code
(the elementwise table's Triton expressions, rendered as the GEMM epilogues render them) over
tiles of the group's shape, rendered from templates/pointwise.py.jinja.

Memory-bound: each input is read once and each output written once. The shape is walked as at
most three dims after merging the dims every operand lays out alike (a dense group is one dim),
the innermost that of the first output's memory; every operand's loads follow its own strides,
so a transposed input is read through them (Triton coalesces each load along the operand's own
contiguous dim) and a broadcast one reads the same values again from cache."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from torch_xaccel.ops.pointwise.program import Program, parse
from torch_xaccel.runtime import interpreting

from .. import cache
from ..gemm_epilogue.render import compute_expr
from ..limits import INT32_LIMIT, cdiv, next_power_of_2, reach
from ..render import Templates
from ..triton_launch import LaunchCache, remember

TEMPLATES = Templates(Path(__file__).parent / "templates")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_DIMS = 3
TILE = 2048  # elements per program
WARPS = 4
_LAUNCHES = LaunchCache()
_KERNELS: dict = {}

_LOAD = ("tl.load(in{j}_ptr + i0 * in{j}_s0 + offs1[:, None] * in{j}_s1 + offs2[None, :] * in{j}_s2, mask=mask, "
         "other=0.0).to(tl.float32)")


def lines(program: Program) -> list[str]:
    """One assignment per IR node: v<i> = ..."""
    out = []
    for i, n in enumerate(program.nodes):
        if n["op"] == "load":
            expr = _LOAD.format(j=n["operand"])
        elif n["op"] == "const":
            expr = repr(float(n["value"]))
        else:
            temps, expr = compute_expr(i, n, "triton")
            out += temps
        out.append(f"v{i} = {expr}")
    return out


def render(program: Program) -> tuple[str, str]:
    """(kernel name, source): shapes, strides and dtypes are launch arguments, so one kernel
    serves a program's ops at any of them (the name hashes the ops)."""
    body = repr((program.nodes, program.outputs))
    name = "pointwise_" + hashlib.sha256(f"{body}|{TEMPLATES.digest}".encode()).hexdigest()[:16]
    src = TEMPLATES.render("pointwise.py.jinja", kernel_name=name, description=program.describe(), program_json=body,
                           n_inputs=program.n_inputs, n_outputs=len(program.outputs), lines=lines(program),
                           outputs=[(k, f"v{o}") for k, o in enumerate(program.outputs)])
    return name, src


def _kernel(program: Program):
    key = (repr(program.nodes), program.outputs, interpreting())
    if key not in _KERNELS:
        name, src = render(program)
        _KERNELS[key] = getattr(cache.load_source(name, src), name)
    return _KERNELS[key]


def merged_dims(shape, strides: list[tuple[int, ...]]) -> tuple[list[int], list[list[int]]] | None:
    """(sizes, per-operand strides) of the same iteration with dims of size 1 dropped, the rest
    ordered outermost first by the first operand's strides (the first output: its stores run
    along its memory) and neighbours merged where every operand steps over them as over one
    dim; padded to MAX_DIMS with leading 1s, or None where more than MAX_DIMS dims remain."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    dims.sort(key=lambda d: -strides[0][d])
    sizes = [shape[d] for d in dims]
    per = [[s[d] for d in dims] for s in strides]
    i = len(sizes) - 2
    while i >= 0:
        if all(p[i] == p[i + 1] * sizes[i + 1] for p in per):
            sizes[i] *= sizes[i + 1]
            del sizes[i + 1]
            for p in per:
                del p[i]
        i -= 1
    if len(sizes) > MAX_DIMS:
        return None
    pad = MAX_DIMS - len(sizes)
    return [1] * pad + sizes, [[0] * pad + p for p in per]


def broadcast_strides(shape, in_shape, in_strides) -> tuple[int, ...]:
    """An input's strides as read over the group's shape: 0 along the dims it broadcasts over."""
    pad = len(shape) - len(in_shape)
    return tuple(0 if d < pad or in_shape[d - pad] == 1 else in_strides[d - pad] for d in range(len(shape)))


def walk(program: Program, input_layouts) -> tuple[list[int], list[list[int]]] | None:
    """merged_dims of a case: the first output (its stores order the dims), every input's
    (shape, strides) broadcast, then the outputs; None where the kernel cannot walk it."""
    strides = [program.strides[0]] + [broadcast_strides(program.shape, s, st) for s, st in input_layouts] \
        + list(program.strides)
    merged = merged_dims(program.shape, strides)
    return None if merged is None else (merged[0], merged[1][1:])


def layout_refusal(program: Program, input_layouts) -> str | None:
    """Why the kernel cannot run a group whose inputs have these (shape, strides), or None. The
    pass asks before it fuses: a call the kernel refuses would run the slower fp32 reference."""
    if program.strides and walk(program, input_layouts) is None:
        return f"its operands are laid out differently over more than {MAX_DIMS} dims"
    return None


def _tiles(D1: int, D2: int, strides: list[list[int]]) -> tuple[int, int]:
    """(BLOCK1, BLOCK2): square tiles where some operand runs along D1 (a transposed input),
    else rows as long as D2 allows."""
    across = any(p[1] == 1 and p[2] != 1 for p in strides)
    if across and D1 > 1:
        return 64, 32
    b2 = min(next_power_of_2(D2), TILE)
    return max(1, min(next_power_of_2(D1), TILE // b2)), b2


def why_not(inputs, program: Program) -> str | None:
    """Why the kernel would not run this call (None: it would)."""
    if program.torch_dtype not in DTYPES or any(t.is_floating_point() is False for t in inputs):
        return f"{program.dtype} outputs or a non-floating input"
    if any(reach(t) >= INT32_LIMIT for t in inputs) or torch.Size(program.shape).numel() >= INT32_LIMIT:
        return "2^31 elements or more"
    return None


def forward(key, inputs, program_json):
    """Kernel path for xaccel::pointwise, or NotImplemented (the reference then runs). What a call
    launches is worked out once per case (the runtime's key: the program and every input's dtype,
    shape and strides): the eager rest calls the op on every step."""
    device = inputs[0].device
    plan = _PLANS.get((key, device))
    if plan is None:
        plan = _plan(inputs, parse(program_json))
        remember(_PLANS, (key, device), plan, 4096)
    if plan is NotImplemented:
        return NotImplemented
    program, kernel, grid, ints, meta = plan
    outs = [torch.empty_strided(program.shape, s, dtype=program.torch_dtype, device=device) for s in program.strides]
    if grid[0] == 0:
        return outs
    tensors = (*inputs, *outs)
    _LAUNCHES.launch((key, device), kernel, grid, (*tensors, *ints), meta, tensors)
    return outs


_PLANS: dict = {}


def _plan(inputs, program: Program):
    """(program, kernel, grid, integer arguments, constexprs) of a case, or NotImplemented."""
    if why_not(inputs, program) is not None:
        return NotImplemented
    outs = [torch.empty_strided(program.shape, s, dtype=program.torch_dtype, device="meta") for s in program.strides]
    if not outs or outs[0].numel() == 0:
        return program, None, (0,), (), {}
    merged = walk(program, [(t.shape, t.stride()) for t in inputs])
    if merged is None:
        return NotImplemented
    (D0, D1, D2), per = merged
    B1, B2 = _tiles(D1, D2, per)
    ints = (D1, D2, *(s for p in per for s in p))
    return program, _kernel(program), (D0 * cdiv(D1, B1) * cdiv(D2, B2),), ints, \
        dict(BLOCK1=B1, BLOCK2=B2, num_warps=WARPS)
