"""Op-input fuzz: every torch.ops.xaccel.* op, called directly, refuses a malformed call (a wrong
rank, size or dtype, an operand of the wrong broadcast kind, a zero chunk size, partial states)
with a ValueError naming the argument, eagerly and in its fake (so torch.compile raises it while
tracing), never with a result of the wrong shape or another exception; and edge sizes (an empty
sequence or batch) return empty results of the right shapes without reaching a kernel provider."""
import json
import pathlib
import random
import re
from functools import partial

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_xaccel
from torch_xaccel import runtime

X = torch.ops.xaccel
GEN = torch.Generator().manual_seed(0)


def r(*shape, dtype=torch.float32) -> torch.Tensor:
    """Fresh random values (never all zeros)."""
    return torch.randn(shape, generator=GEN).to(dtype)


def grown(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A fresh tensor like t with one more entry along dim."""
    shape = list(t.shape)
    shape[dim] += 1
    return r(*shape, dtype=t.dtype)


def ints(t: torch.Tensor) -> torch.Tensor:
    return torch.randint(1, 9, t.shape, generator=GEN)


# ---- one valid call per op, at the module's sizes or the edge sizes given (no size is 7: the fuzz
# appends dims of 7)

B, H, S, DK, DV = 2, 3, 5, 4, 6
T, NH, D = 3, 2, 4


def _mlstm(B=B, S=S) -> dict:
    return dict(q=r(B, H, S, DK), k=r(B, H, S, DK), v=r(B, H, S, DV), i=r(B, H, S), f=r(B, H, S) + 2,
                C0=r(B, H, DK, DV), n0=r(B, H, DK), m0=r(B, H), eps=1e-6, chunk_size=4, seq_major_h=False)


def _mlstm_backward(B=B, S=S) -> dict:
    fw = _mlstm(B, S)
    h, C, n, m, *kept = X.mlstm_saving(*fw.values())
    del fw["seq_major_h"]
    return dict(gh=r(B, H, S, DV), gC=r(B, H, DK, DV), gn=r(B, H, DK), gm=r(B, H), **fw, h=h, kept=[*kept, C, n, m])


def _mlstm_step(B=B) -> dict:
    return dict(q=r(B, H, DK), k=r(B, H, DK), v=r(B, H, DV), i=r(B, H), f=r(B, H), C=r(B, H, DK, DV),
                n=r(B, H, DK), m=r(B, H), eps=1e-6, scale_q=False)


def _slstm(B=B, T=T) -> dict:
    return dict(Wx=r(B, T, 4, NH, D), R=r(NH, 4, D, D) * 0.3, b=r(4, NH, D), h0=r(B, NH, D), c0=r(B, NH, D),
                n0=r(B, NH, D).abs() + 0.5, m0=r(B, NH, D), fresh="element", clamp_gates=False, clamp_n=False)


def _slstm_backward(T=T) -> dict:
    fw = _slstm(T=T)
    y, *_, raw, cnm = X.slstm_saving(*fw.values())
    variant = {k: fw.pop(k) for k in ("fresh", "clamp_gates", "clamp_n")}
    return dict(gy=r(B, T, NH, D), ghT=r(B, NH, D), gcT=r(B, NH, D), gnT=r(B, NH, D), gmT=r(B, NH, D), **fw,
                **variant, y=y, kept=[raw, cnm])


def _slstm_step(B=B) -> dict:
    return dict(Wx=r(B, 4, NH, D), R=r(NH, 4, D, D) * 0.3, b=r(4, NH, D), h=r(B, NH, D), c=r(B, NH, D),
                n=r(B, NH, D).abs() + 0.5, m=r(B, NH, D), fresh="element", clamp_gates=False, clamp_n=False)


M, K, N = 3, 5, 4
EPILOGUE = json.dumps({"v": 1, "outputs": [8], "nodes": [
    {"op": "acc", "index": 0}, {"op": "load", "operand": 0, "bcast": "row"}, {"op": "add", "in": [0, 1]},
    {"op": "load", "operand": 1, "bcast": "col"}, {"op": "mul", "in": [2, 3]},
    {"op": "load", "operand": 2, "bcast": "full"}, {"op": "add", "in": [4, 5]},
    {"op": "load", "operand": 3, "bcast": "scalar"}, {"op": "mul", "in": [6, 7]}]})


def _gemm_epilogue(M=M) -> dict:
    # operands: a row [N], a column [M, 1], a full [M, N] and a scalar
    return dict(a=r(M, K), bs=[r(N, K)], operands=[r(N), r(M, 1), r(M, N), r()], epilogue=EPILOGUE,
                b_transposed=True)


HO, HD = 6, 5  # headwise: blocks [O, D] of H heads


def _headwise(B=B) -> dict:
    return dict(x=r(B, S, H, HD), w=r(H, HO, HD), addend=r(B, S, H, HO))


def _headwise_weight_grad(S=S) -> dict:
    return dict(dy=r(B, S, H, HO), x=r(B, S, H, HD))


CC, KS = 3, 4  # causal_conv: channels, kernel size


def _causal_conv1d(B=B, S=S) -> dict:
    return dict(x=r(B, CC, S), w=r(CC, KS), bias=r(CC))


def _causal_conv1d_backward(S=S) -> dict:
    return dict(dy=r(B, CC, S), x=r(B, CC, S), w=r(CC, KS), with_bias=True)


GN, GC = 5, 6  # group_norm: rows, channels (2 groups)


def _group_norm(GN=GN) -> dict:
    return dict(x=r(GN, GC), weight=r(GC), bias=r(GC), groups=2, eps=1e-5)


def _group_norm_backward(GN=GN) -> dict:
    return dict(dy=r(GN, GC), x=r(GN, GC), weight=r(GC), groups=2, eps=1e-5, with_bias=True)


K1, K2, SN = 4, 5, 6  # skinny_linear: two inputs' widths, outputs


def _skinny_linear(B=B) -> dict:
    return dict(weight=r(SN, K1 + K2), bias=r(SN), xs=[r(B, T, K1), r(B, T, K2)])


def _skinny_linear_backward(T=T) -> dict:
    return dict(dy=r(B, T, SN), weight=r(SN, K1 + K2), xs=[r(B, T, K1), r(B, T, K2)], with_bias=True,
                addends=[r(B, T, K1), None])


def _program(shape=(4, 8), strides=((8, 1),)) -> str:
    return json.dumps({"v": 1, "nodes": [{"op": "load", "operand": 0, "bcast": "full"},
                                         {"op": "load", "operand": 1, "bcast": "full"}, {"op": "mul", "in": [0, 1]},
                                         {"op": "silu", "in": [2]}],
                       "outputs": [3], "shape": list(shape), "strides": [list(s) for s in strides],
                       "dtype": "float32"})


def _pointwise() -> dict:
    return dict(inputs=[r(4, 8), r(8)], program=_program())


VALID = {"mlstm": _mlstm, "mlstm_saving": _mlstm, "mlstm_backward": _mlstm_backward,
         "mlstm_step": _mlstm_step, "slstm": _slstm, "slstm_saving": _slstm, "slstm_backward": _slstm_backward,
         "slstm_step": _slstm_step, "gemm_epilogue": _gemm_epilogue, "headwise": _headwise,
         "headwise_weight_grad": _headwise_weight_grad, "causal_conv1d": _causal_conv1d,
         "causal_conv1d_backward": _causal_conv1d_backward, "group_norm": _group_norm,
         "group_norm_backward": _group_norm_backward, "skinny_linear": _skinny_linear,
         "skinny_linear_backward": _skinny_linear_backward, "pointwise": _pointwise}


def call(op: str, args: dict):
    return getattr(X, op)(*args.values())


def call_fake(op: str, args: dict):
    """The op's fake function on fake copies of the arguments."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {k: _map(v, mode.from_tensor) for k, v in args.items()}
        return call(op, fake)


def _map(v, fn):
    if isinstance(v, torch.Tensor):
        return fn(v)
    if isinstance(v, list):
        return [_map(x, fn) for x in v]
    return v


def _shapes(out) -> list:
    return [tuple(o.shape) for o in (out if isinstance(out, (list, tuple)) else [out])]


def test_every_op_is_covered():
    ops = pathlib.Path(torch_xaccel.__file__).parent / "ops"
    registered = {m for path in ops.rglob("*.py") for m in re.findall(r'custom_op\("xaccel::(\w+)"', path.read_text())}
    assert registered == set(VALID)


@pytest.mark.parametrize("op", sorted(VALID))
def test_valid_calls_run_and_their_fakes_agree(op):
    args = VALID[op]()
    assert _shapes(call(op, args)) == _shapes(call_fake(op, args))


# ---- malformed calls: (op, the argument the error names, the change to a valid call) ------------

SEQUENCE = ("mlstm", "mlstm_saving")
MALFORMED = [
    *[(op, name, change) for op in SEQUENCE for name, change in [
        ("q", lambda a: {"q": r(B, H, S)}),
        ("k", lambda a: {"k": grown(a["k"], 2)}),  # extra time steps were dropped silently
        ("v", lambda a: {"v": grown(a["v"], 2)}),
        ("i", lambda a: {"i": grown(a["i"], 2)}),
        ("f", lambda a: {"f": grown(a["f"], 0)}),
        ("m0", lambda a: {"m0": r(B, H, 1)}),  # the xlstm package's layout gave a 5-D output
        ("C0", lambda a: {"C0": grown(a["C0"], 3)}),
        ("n0", lambda a: {"n0": grown(a["n0"], 2)}),
        ("q", lambda a: {"q": ints(a["q"]), "k": ints(a["k"]), "v": ints(a["v"])}),  # integer garbage
        ("k", lambda a: {"k": a["k"].double()}),
        ("i", lambda a: {"i": ints(a["i"])}),
        ("chunk_size", lambda a: {"chunk_size": 0}),  # ZeroDivisionError
        ("q", lambda a: {"q": r(B, H, S, 0), "k": r(B, H, S, 0), "C0": r(B, H, 0, DV), "n0": r(B, H, 0)}),  # DK=0
        ("n0", lambda a: {"n0": None, "m0": None}),  # AttributeError
    ]],
    ("mlstm_backward", "gh", lambda a: {"gh": grown(a["gh"], 2)}),
    ("mlstm_backward", "gC", lambda a: {"gC": grown(a["gC"], 2)}),
    ("mlstm_backward", "gm", lambda a: {"gm": r(B, H, 1)}),
    ("mlstm_backward", "h", lambda a: {"h": r(B, H, S)}),
    ("mlstm_backward", "kept", lambda a: {"kept": a["kept"][:3]}),
    ("mlstm_backward", r"kept\[0\]", lambda a: {"kept": [grown(a["kept"][0], 2), *a["kept"][1:]]}),
    ("mlstm_backward", "q", lambda a: {"q": ints(a["q"])}),
    ("mlstm_backward", "m0", lambda a: {"m0": None}),
    ("mlstm_backward", "chunk_size", lambda a: {"chunk_size": 0}),
    ("mlstm_step", "i", lambda a: {"i": r(B, H, 1)}),  # returned [B, H, B, DV]
    ("mlstm_step", "f", lambda a: {"f": r(B, H, 1)}),
    ("mlstm_step", "m", lambda a: {"m": r(B, H, 1)}),
    ("mlstm_step", "C", lambda a: {"C": grown(a["C"], 3)}),
    ("mlstm_step", "n", lambda a: {"n": grown(a["n"], 0)}),
    ("mlstm_step", "v", lambda a: {"v": grown(a["v"], 1)}),
    ("mlstm_step", "q", lambda a: {"q": ints(a["q"])}),
    ("mlstm_step", "q", lambda a: {"q": r(B, H, 0), "k": r(B, H, 0), "C": r(B, H, 0, DV), "n": r(B, H, 0)}),
    *[(op, name, change) for op in ("slstm", "slstm_saving") for name, change in [
        ("Wx", lambda a: {"Wx": r(B, T, NH, D)}),
        ("Wx", lambda a: {"Wx": r(B, T, 3, NH, D)}),
        ("Wx", lambda a: {"Wx": ints(a["Wx"])}),
        ("R", lambda a: {"R": grown(a["R"], 3)}),
        ("b", lambda a: {"b": grown(a["b"], 1)}),
        ("fresh", lambda a: {"fresh": "rowwise"}),
        ("c0", lambda a: {"c0": None, "n0": None, "m0": None}),
        ("c0", lambda a: {"c0": grown(a["c0"], 0)}),
        ("m0", lambda a: {"m0": ints(a["m0"])}),
    ]],
    ("slstm_backward", "gy", lambda a: {"gy": grown(a["gy"], 1)}),
    ("slstm_backward", "ghT", lambda a: {"ghT": grown(a["ghT"], 2)}),
    ("slstm_backward", "y", lambda a: {"y": r(B, T, NH)}),
    ("slstm_backward", "kept", lambda a: {"kept": a["kept"][:1]}),
    ("slstm_backward", r"kept\[1\]", lambda a: {"kept": [a["kept"][0], grown(a["kept"][1], 2)]}),
    ("slstm_backward", "Wx", lambda a: {"Wx": ints(a["Wx"])}),
    ("slstm_backward", "h0", lambda a: {"h0": None}),
    ("slstm_step", "Wx", lambda a: {"Wx": r(B, 1, 4, NH, D)}),
    ("slstm_step", "h", lambda a: {"h": grown(a["h"], 2)}),
    ("slstm_step", "R", lambda a: {"R": grown(a["R"], 0)}),
    ("slstm_step", "n", lambda a: {"n": ints(a["n"])}),
    ("gemm_epilogue", "a", lambda a: {"a": ints(a["a"])}),
    ("gemm_epilogue", "a", lambda a: {"a": r(K)}),
    ("gemm_epilogue", "bs", lambda a: {"bs": []}),
    ("gemm_epilogue", r"bs\[0\]", lambda a: {"bs": [r(N, K + 1)]}),
    ("gemm_epilogue", r"bs\[0\]", lambda a: {"bs": [r(N, K, dtype=torch.float64)]}),
    ("gemm_epilogue", r"operands\[0\]", lambda a: {"operands": [r(M, N), *a["operands"][1:]]}),
    ("gemm_epilogue", r"operands\[1\]", lambda a: {"operands": [a["operands"][0], r(M, N), *a["operands"][2:]]}),
    ("gemm_epilogue", r"operands\[1\]", lambda a: {"operands": [a["operands"][0], r(N), *a["operands"][2:]]}),
    ("gemm_epilogue", r"operands\[2\]", lambda a: {"operands": [*a["operands"][:2], r(N), a["operands"][3]]}),
    ("gemm_epilogue", r"operands\[3\]", lambda a: {"operands": [*a["operands"][:3], r(N)]}),  # a row as a scalar
    ("gemm_epilogue", r"operands\[3\]", lambda a: {"operands": [*a["operands"][:3], ints(r())]}),
    ("gemm_epilogue", "operands", lambda a: {"operands": a["operands"][:2]}),
    ("headwise", "x", lambda a: {"x": r(HD)}),
    ("headwise", "x", lambda a: {"x": ints(a["x"])}),
    ("headwise", "w", lambda a: {"w": grown(a["w"], 2)}),
    ("headwise", "w", lambda a: {"w": grown(a["w"], 0)}),
    ("headwise", "addend", lambda a: {"addend": grown(a["addend"], 3)}),
    ("headwise", "addend", lambda a: {"addend": a["addend"].double()}),
    ("headwise_weight_grad", "dy", lambda a: {"dy": grown(a["dy"], 2)}),
    ("headwise_weight_grad", "x", lambda a: {"x": ints(a["x"])}),
    ("causal_conv1d", "x", lambda a: {"x": r(CC, S)}),
    ("causal_conv1d", "x", lambda a: {"x": ints(a["x"]), "w": ints(a["w"])}),  # integer garbage
    ("causal_conv1d", "w", lambda a: {"w": grown(a["w"], 0)}),
    ("causal_conv1d", "w", lambda a: {"w": r(CC, 0)}),
    ("causal_conv1d", "bias", lambda a: {"bias": grown(a["bias"], 0)}),
    ("causal_conv1d_backward", "dy", lambda a: {"dy": grown(a["dy"], 2)}),
    ("causal_conv1d_backward", "x", lambda a: {"x": ints(a["x"])}),
    ("group_norm", "x", lambda a: {"x": r(GN, GC, 1)}),
    ("group_norm", "x", lambda a: {"x": ints(a["x"])}),  # integer garbage
    ("group_norm", "groups", lambda a: {"groups": 0}),  # ZeroDivisionError
    ("group_norm", "groups", lambda a: {"groups": 4}),
    ("group_norm", "weight", lambda a: {"weight": grown(a["weight"], 0)}),
    ("group_norm", "bias", lambda a: {"bias": r(GC, 1)}),
    ("group_norm_backward", "dy", lambda a: {"dy": grown(a["dy"], 0)}),
    ("group_norm_backward", "groups", lambda a: {"groups": 0}),
    ("skinny_linear", "weight", lambda a: {"weight": r(K1 + K2)}),
    ("skinny_linear", "weight", lambda a: {"weight": ints(a["weight"])}),
    ("skinny_linear", "xs", lambda a: {"xs": []}),
    ("skinny_linear", r"xs\[1\]", lambda a: {"xs": [a["xs"][0], grown(a["xs"][1], 0)]}),
    ("skinny_linear", "xs", lambda a: {"xs": [a["xs"][0], grown(a["xs"][1], 2)]}),
    ("skinny_linear", r"xs\[0\]", lambda a: {"xs": [a["xs"][0].double(), a["xs"][1]]}),
    ("skinny_linear", "bias", lambda a: {"bias": grown(a["bias"], 0)}),
    ("skinny_linear_backward", "dy", lambda a: {"dy": grown(a["dy"], 2)}),
    ("skinny_linear_backward", "addends", lambda a: {"addends": [None]}),
    ("skinny_linear_backward", r"addends\[0\]", lambda a: {"addends": [grown(a["xs"][0], 1), None]}),
    ("skinny_linear_backward", r"addends\[1\]", lambda a: {"addends": [None, a["xs"][1].double()]}),
    ("pointwise", "inputs", lambda a: {"inputs": a["inputs"][:1]}),
    ("pointwise", r"inputs\[1\]", lambda a: {"inputs": [a["inputs"][0], r(5)]}),
    ("pointwise", r"inputs\[0\]", lambda a: {"inputs": [ints(a["inputs"][0]), a["inputs"][1]]}),
    ("pointwise", r"inputs\[0\]", lambda a: {"inputs": [a["inputs"][0].double(), a["inputs"][1]]}),
    ("pointwise", "program", lambda a: {"program": _program(strides=((1, 1),))}),  # overlapping: wrong values
    ("pointwise", "program", lambda a: {"program": _program(strides=((1, 0),))}),
]


@pytest.mark.parametrize("op,name,change", MALFORMED, ids=[f"{op}-{k}" for k, (op, _, _) in enumerate(MALFORMED)])
def test_a_malformed_call_raises_a_value_error_naming_the_argument(op, name, change):
    args = VALID[op]()
    args.update(change(args))
    pattern = rf"xaccel::{op}: .*(?<!\w){name}(?!\w)"
    with pytest.raises(ValueError, match=pattern):
        call(op, args)
    with pytest.raises(ValueError, match=pattern):
        call_fake(op, args)


def test_torch_compile_of_a_malformed_direct_call_raises_while_tracing():
    args = _mlstm()
    args["k"] = grown(args["k"], 2)
    fn = torch.compile(lambda *a: X.mlstm(*a), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"ValueError.*xaccel::mlstm: k must be \[B, H, S, DK\]"):
        fn(*args.values())


def test_dynamic_shapes_trace_once_without_guards_from_the_checks():
    """The checks compare symbolic sizes without guards: one graph serves every sequence length."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda *t: X.mlstm(*t, 1e-6, 4)[0], backend=backend, dynamic=True)
    for s in (5, 9, 12):
        args = _mlstm(S=s)
        assert fn(*list(args.values())[:8]).shape == (B, H, s, DV)
    assert len(graphs) == 1


# ---- the fuzz: one argument of a valid call mutated at random ------------------------------------

# each tensor argument's dims: a letter is a size the op ties to another argument's dim of the same
# letter, a digit a size the op fixes, "!" a size tied by a relation (a sum of widths, a
# broadcast), "*" a free size; "~" first marks an argument that takes any number of leading dims
LAYOUTS = {
    "mlstm": dict(q="BHSK", k="BHSK", v="BHSV", i="BHS", f="BHS", C0="BHKV", n0="BHK", m0="BH"),
    "mlstm_backward": dict(gh="BHSV", gC="BHKV", gn="BHK", gm="BH", q="BHSK", k="BHSK", v="BHSV", i="BHS", f="BHS",
                           C0="BHKV", n0="BHK", m0="BH", h="BHSV", **{
                               "kept.0": "BHNKV", "kept.1": "BHNK", "kept.2": "BHN", "kept.3": "BH2S",
                               "kept.4": "BHKV", "kept.5": "BHK", "kept.6": "BH"}),
    "mlstm_step": dict(q="BHK", k="BHK", v="BHV", i="BH", f="BH", C="BHKV", n="BHK", m="BH"),
    "slstm": dict(Wx="BT4ND", R="N4DD", b="4ND", h0="BND", c0="BND", n0="BND", m0="BND"),
    "slstm_backward": dict(gy="BTND", ghT="BND", gcT="BND", gnT="BND", gmT="BND", Wx="BT4ND", R="N4DD", b="4ND",
                           h0="BND", c0="BND", n0="BND", m0="BND", y="BTND", **{"kept.0": "BT4ND", "kept.1": "3BTND"}),
    "slstm_step": dict(Wx="B4ND", R="N4DD", b="4ND", h="BND", c="BND", n="BND", m="BND"),
    "gemm_epilogue": {"a": "~MK", "bs.0": "NK", "operands.0": "N", "operands.1": "M1", "operands.2": "MN",
                      "operands.3": ""},
    "headwise": dict(x="~BSHD", w="HOD", addend="BSHO"),
    "headwise_weight_grad": dict(dy="BSHO", x="~BSHD"),
    "causal_conv1d": dict(x="BCS", w="C*", bias="C"),
    "causal_conv1d_backward": dict(dy="BCS", x="BCS", w="C*"),
    "group_norm": dict(x="NC", weight="C", bias="C"),
    "group_norm_backward": dict(dy="NC", x="NC", weight="C"),
    "skinny_linear": {"weight": "N!", "bias": "N", "xs.0": "~BT!", "xs.1": "BT!"},
    "skinny_linear_backward": {"dy": "BTN", "weight": "N!", "xs.0": "~BT!", "xs.1": "BT!", "addends.0": "BT!"},
    "pointwise": {"inputs.0": "~!!", "inputs.1": "~!"},
}
LAYOUTS["mlstm_saving"] = LAYOUTS["mlstm"]
LAYOUTS["slstm_saving"] = LAYOUTS["slstm"]


def _tied(layouts: dict, path: str, dim: int) -> bool:
    """Whether changing that size alone breaks the op's contract."""
    label = layouts[path].lstrip("~")[dim]
    return label != "*" and (not label.isalpha() or sum(v.count(label) for v in layouts.values()) > 1)


def _mutations(op: str) -> list:
    """(path, kind, dim) for every mutation the op must refuse."""
    out = []
    for path, layout in LAYOUTS[op].items():
        dims = layout.lstrip("~")
        out += [(path, "dtype", None), (path, "append", None)]
        if dims and not layout.startswith("~"):
            out.append((path, "drop", None))
        out += [(path, "size", d) for d in range(len(dims)) if _tied(LAYOUTS[op], path, d)]
    return out


def _mutated(t: torch.Tensor, kind: str, dim, rng: random.Random) -> torch.Tensor:
    if kind == "dtype":
        return ints(t).to(rng.choice((torch.int64, torch.int32, torch.bool)))
    if kind == "append":
        return r(*t.shape, 7, dtype=t.dtype)
    if kind == "drop":
        return r(*t.shape[:-1], dtype=t.dtype)
    return grown(t, dim)


def _replace(args: dict, path: str, value) -> None:
    name, _, index = path.partition(".")
    if index:
        args[name] = list(args[name])
        args[name][int(index)] = value
    else:
        args[name] = value


def _get(args: dict, path: str):
    name, _, index = path.partition(".")
    return args[name][int(index)] if index else args[name]


FUZZ_CASES = 60


@pytest.mark.parametrize("seed", range(FUZZ_CASES))
def test_fuzz_one_mutated_argument_raises_a_value_error(seed):
    rng = random.Random(seed)
    op = rng.choice(sorted(VALID))
    path, kind, dim = rng.choice(_mutations(op))
    args = VALID[op]()
    _replace(args, path, _mutated(_get(args, path), kind, dim, rng))
    with pytest.raises(ValueError, match=rf"xaccel::{op}: "):
        call(op, args)
    with pytest.raises(ValueError, match=rf"xaccel::{op}: "):
        call_fake(op, args)


# ---- edge sizes ----------------------------------------------------------------------------------

EDGES = [
    ("mlstm", partial(_mlstm, S=0)),
    ("mlstm", partial(_mlstm, B=0)),
    ("mlstm_saving", partial(_mlstm, S=0)),
    ("mlstm_backward", partial(_mlstm_backward, S=0)),
    ("mlstm_backward", partial(_mlstm_backward, B=0)),
    ("mlstm_step", partial(_mlstm_step, B=0)),
    ("slstm", partial(_slstm, T=0)),
    ("slstm", partial(_slstm, B=0)),
    ("slstm_saving", partial(_slstm, T=0)),
    ("slstm_backward", partial(_slstm_backward, T=0)),
    ("slstm_step", partial(_slstm_step, B=0)),
    ("gemm_epilogue", partial(_gemm_epilogue, M=0)),
    ("headwise", partial(_headwise, B=0)),
    ("headwise_weight_grad", partial(_headwise_weight_grad, S=0)),
    ("causal_conv1d", partial(_causal_conv1d, S=0)),
    ("causal_conv1d", partial(_causal_conv1d, B=0)),
    ("causal_conv1d_backward", partial(_causal_conv1d_backward, S=0)),
    ("group_norm", partial(_group_norm, GN=0)),
    ("group_norm_backward", partial(_group_norm_backward, GN=0)),
    ("skinny_linear", partial(_skinny_linear, B=0)),
    ("skinny_linear_backward", partial(_skinny_linear_backward, T=0)),
    ("pointwise", lambda: dict(inputs=[r(0, 8), r(8)], program=_program(shape=(0, 8)))),
]


@pytest.fixture
def dispatched(monkeypatch):
    """The ops that reach runtime.dispatch (where a kernel provider may take the call)."""
    calls = []
    real = runtime.dispatch

    def recording(op, *args):
        calls.append(op)
        return real(op, *args)

    monkeypatch.setattr(runtime, "dispatch", recording)
    return calls


@pytest.mark.parametrize("op,make", EDGES, ids=[f"{op}-{k}" for k, (op, _) in enumerate(EDGES)])
def test_edge_sizes_return_empty_results_without_reaching_a_kernel(op, make, dispatched):
    args = make()
    out = call(op, args)
    assert _shapes(out) == _shapes(call_fake(op, args))
    assert dispatched == []


def test_a_nonempty_call_is_dispatched(dispatched):
    call("group_norm", _group_norm())
    assert dispatched == ["group_norm"]


def _same_values_not_aliases(got, want) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.to(g.dtype))
        assert g.data_ptr() != w.data_ptr()


@pytest.mark.parametrize("with_state", [True, False])
def test_mlstm_at_s0_returns_the_start_state(with_state):
    args = _mlstm(S=0)
    if not with_state:
        args.update(C0=None, n0=None, m0=None)
    h, C, n, m, Cs, ns, ms, rows = X.mlstm_saving(*args.values())
    assert h.shape == (B, H, 0, DV) and Cs.shape == (B, H, 0, DK, DV) and rows.shape == (B, H, 2, 0)
    if with_state:
        _same_values_not_aliases((C, n, m), (args["C0"], args["n0"], args["m0"]))
    else:
        assert not C.any() and not n.any() and (m == float("-inf")).all()


def test_mlstm_backward_at_s0_passes_the_final_state_gradients_to_the_start_state():
    args = _mlstm_backward(S=0)
    grads = call("mlstm_backward", args)
    assert [g.shape for g in grads[:5]] == [args[k].shape for k in "qkvif"]
    _same_values_not_aliases(grads[5:], (args["gC"], args["gn"], args["gm"]))


@pytest.mark.parametrize("with_state", [True, False])
def test_slstm_at_t0_returns_the_start_state(with_state):
    args = _slstm(T=0)
    if not with_state:
        args.update(h0=None, c0=None, n0=None, m0=None)
    y, *final = call("slstm", args)
    assert y.shape == (B, 0, NH, D)
    if with_state:
        _same_values_not_aliases(final, (args["h0"], args["c0"], args["n0"], args["m0"]))
    else:
        assert not any(s.any() for s in final)


def test_slstm_backward_at_t0_passes_the_final_state_gradients_to_the_start_state():
    args = _slstm_backward(T=0)
    dWx, dR, db, *dstate = call("slstm_backward", args)
    assert dWx.shape == args["Wx"].shape and not dR.any() and not db.any()
    _same_values_not_aliases(dstate, (args["ghT"], args["gcT"], args["gnT"], args["gmT"]))


def test_empty_backward_weight_gradients_are_zeros():
    dx, dw, db = call("causal_conv1d_backward", _causal_conv1d_backward(S=0))
    assert dx.shape == (B, CC, 0) and dw.shape == (CC, KS) and db.shape == (CC,) and not dw.any() and not db.any()
    dx, dw, db = call("group_norm_backward", _group_norm_backward(GN=0))
    assert dx.shape == (0, GC) and dw.shape == db.shape == (GC,) and not dw.any() and not db.any()
    *dxs, dweight, dbias = call("skinny_linear_backward", _skinny_linear_backward(T=0))
    assert [d.shape for d in dxs] == [(B, 0, K1), (B, 0, K2)] and not dweight.any() and not dbias.any()
