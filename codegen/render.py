"""Render Triton sources from jinja2 templates. The epilogue IR becomes straight-line fp32 code
applied to the accumulator tile before the single store."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import jinja2

from torch_xaccel.epilogue_ir import Epilogue

TEMPLATES = Path(__file__).parent / "templates"
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), trim_blocks=True,
                          lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)

_UNARY = {
    "relu": "tl.maximum({x}, 0.0)",
    "gelu": "0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))",
    "gelu_tanh": "0.5 * {x} * (1.0 + _tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})))",
    "silu": "{x} * tl.sigmoid({x})",
    "sigmoid": "tl.sigmoid({x})",
    "tanh": "_tanh({x})",
}
_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
# g times the activation's derivative at x (ATen's *_backward formulas); t: a temporary for the node
_GRAD = {
    "gelu_grad": ["{g} * (0.5 * (1.0 + tl.erf({x} * 0.7071067811865476)) + {x} * 0.3989422804014327 * tl.exp(-0.5 * {x} * {x}))"],
    "gelu_tanh_grad": ["{t} = _tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x}))",
                       "{g} * (0.5 * (1.0 + {t}) + 0.5 * {x} * (1.0 - {t} * {t}) * 0.7978845608028654 * (1.0 + 0.134145 * {x} * {x}))"],
    "silu_grad": ["{t} = tl.sigmoid({x})", "{g} * {t} * (1.0 + {x} * (1.0 - {t}))"],
    "sigmoid_grad": ["{g} * (1.0 - {x}) * {x}"],
    "tanh_grad": ["{g} * (1.0 - {x} * {x})"],
    "relu_grad": ["tl.where({x} > 0.0, {g}, 0.0)"],
}
_LOAD = {
    "full": "tl.load(op{j}_ptr + offs_m[:, None] * op{j}_sm + offs_n[None, :] * op{j}_sn, mask=mask, other=0.0).to(tl.float32)",
    "row": "tl.load(op{j}_ptr + offs_n * op{j}_sn, mask=mask_n, other=0.0).to(tl.float32)[None, :]",
    "col": "tl.load(op{j}_ptr + offs_m * op{j}_sm, mask=mask_m, other=0.0).to(tl.float32)[:, None]",
    "scalar": "tl.load(op{j}_ptr).to(tl.float32)",
}


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
            temps, expr = compute_expr(i, n, _UNARY, _GRAD, _BINARY)
            lines += temps
        lines.append(f"v{i} = {expr}")
    return lines


def compute_expr(i: int, n: dict, unary: dict, grad: dict, binary: dict) -> tuple[list[str], str]:
    """(temporaries, expression) of compute node i (unary, grad or binary) over the values v<j>, from a
    renderer's tables (Triton's here, C++ in cutlass_gemm); grad formulas may assign temporaries t<i>."""
    op = n["op"]
    if op in unary:
        return [], unary[op].format(x=f"v{n['in'][0]}")
    if op in grad:
        names = dict(g=f"v{n['in'][0]}", x=f"v{n['in'][1]}", t=f"t{i}")
        *temps, last = grad[op]
        return [t.format(**names) for t in temps], last.format(**names)
    x, y = n["in"]
    return [], f"v{x} {binary[op]} v{y}"


# tma2: the persistent TMA kernel whose epilogue runs on two BLOCK_N/2 halves of the tile in turn,
# halving the registers the chain's temporaries need next to the accumulator
VARIANTS = {"ptr": "gemm_epilogue.py.jinja", "tma": "gemm_epilogue_tma.py.jinja", "tma2": "gemm_epilogue_tma.py.jinja"}


def render_gemm_epilogue(ep: Epilogue, n_operands: int, input_precision: str, variant: str = "ptr",
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
    src = _ENV.get_template(VARIANTS[variant]).render(
        kernel_name=name, n_gemms=ep.num_accs, n_operands=n_operands, n_outputs=len(ep.outputs),
        description=ep.describe(), epilogue_json=ep.to_json(), epilogue_lines=epilogue_lines(ep),
        outputs=[(k, f"v{o}") for k, o in enumerate(ep.outputs)], input_precision=input_precision,
        b_transposed=b_transposed, sizes_constexpr=sizes_constexpr, subtile=variant == "tma2",
        lines_a=epilogue_lines(ep, "_a"), lines_b=epilogue_lines(ep, "_b"))
    return name, src


@functools.lru_cache(maxsize=None)
def template_digest() -> str:
    """Changes whenever any template changes: part of every cache key."""
    h = hashlib.sha256()
    for p in sorted(TEMPLATES.glob("*.jinja")):
        h.update(p.read_bytes())
    return h.hexdigest()[:12]
