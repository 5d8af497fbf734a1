"""Triton sources for xaccel::gemm_epilogue: the epilogue IR becomes straight-line fp32 code
applied to the accumulator tile before the single store (templates/gemm_epilogue*.py.jinja)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from torch_xaccel.ops.gemm_epilogue import elementwise
from torch_xaccel.ops.gemm_epilogue.epilogue_ir import Epilogue

from ..render import Templates

TEMPLATES = Templates(Path(__file__).parent / "templates", csrc=("gemm_epilogue",))

_LOAD = {
    "full": ("tl.load(op{j}_ptr + offs_m[:, None] * op{j}_sm + offs_n[None, :] * op{j}_sn, mask=mask, other=0.0)"
             ".to(tl.float32)"),
    "row": "tl.load(op{j}_ptr + offs_n * op{j}_sn, mask=mask_n, other=0.0).to(tl.float32)[None, :]",
    "col": "tl.load(op{j}_ptr + offs_m * op{j}_sm, mask=mask_m, other=0.0).to(tl.float32)[:, None]",
    "scalar": "tl.load(op{j}_ptr).to(tl.float32)",
}


def compute_expr(i: int, n: dict, backend: str) -> tuple[list[str], str]:
    """(temporaries, expression) of compute node i (unary, binary or grad) over the values v<j>,
    in a renderer's language ("triton" or "cutlass": the elementwise table's strings)."""
    ins = [f"v{j}" for j in n["in"]]
    if elementwise.BY_NAME[n["op"]].kind == "grad":
        names = dict(g=ins[0], x=ins[1], t=f"t{i}")
    else:
        names = dict(zip("xy", ins), t=f"t{i}")
    return elementwise.expression(n["op"], backend, names)


def epilogue_lines(ep: Epilogue, acc_suffix: str = "") -> list[str]:
    """One assignment per IR node: v<i> = ...; repeated loads of one operand are read once.
    acc_suffix picks the accumulator tile the chain reads (acc0_a: the first half of a sub-tiled tile)."""
    lines, loaded = [], {}
    for i, n in enumerate(ep.nodes):
        op = n["op"]
        if op == "acc":
            expr = f"acc{n['index']}{acc_suffix}"
        elif op == "const":
            expr = repr(float(n["value"]))
        elif op == "load":
            key = (n["operand"], n["bcast"])
            expr = loaded.get(key) or _LOAD[n["bcast"]].format(j=n["operand"])
            loaded.setdefault(key, f"v{i}")
        else:
            temps, expr = compute_expr(i, n, "triton")
            lines += temps
        lines.append(f"v{i} = {expr}")
    return lines


# tma2: the persistent TMA kernel whose epilogue runs on two BLOCK_N/2 halves of the tile in turn,
# halving the registers the chain's temporaries need next to the accumulator
VARIANTS = {"ptr": "gemm_epilogue.py.jinja", "tma": "gemm_epilogue_tma.py.jinja", "tma2": "gemm_epilogue_tma.py.jinja"}


def render_triton(ep: Epilogue, n_operands: int, input_precision: str, variant: str = "ptr",
                  b_transposed: bool = True, sizes_constexpr: bool = False) -> tuple[str, str]:
    """(kernel name, Python source). variant "ptr": one tile per program, pointer loads (any
    strides); "tma": persistent, tensor-descriptor loads (Hopper); "tma2": tma with the epilogue
    on two half tiles. All run in Triton's interpreter too.
    sizes_constexpr makes M, N, K compile-time constants: Triton 3.6's interpreter cannot loop to
    a run-time bound under NumPy 2 (it hands scalars over as 1-element arrays).
    The name carries a hash of everything that shapes the source."""
    digest = hashlib.sha256(f"{ep.to_json()}|{n_operands}|{input_precision}|{variant}|{b_transposed}|{sizes_constexpr}"
                            .encode()).hexdigest()[:12]
    name = f"gemm_epilogue_{ep.num_accs}x_{variant}_{digest}"
    src = TEMPLATES.render(
        VARIANTS[variant], kernel_name=name, n_gemms=ep.num_accs, n_operands=n_operands, n_outputs=len(ep.outputs),
        description=ep.describe(), epilogue_json=ep.to_json(), epilogue_lines=epilogue_lines(ep),
        outputs=[(k, f"v{o}") for k, o in enumerate(ep.outputs)], input_precision=input_precision,
        b_transposed=b_transposed, sizes_constexpr=sizes_constexpr, subtile=variant == "tma2",
        lines_a=epilogue_lines(ep, "_a"), lines_b=epilogue_lines(ep, "_b"))
    return name, src
