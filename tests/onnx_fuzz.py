"""A seeded generator of small random models of the forms xaccel fuses, and their differential check
as ONNX exports (tests/test_onnx_dynamic.py runs it).

Each case is a module written out as source (a failing case prints a standalone reproducer): a
stack of blocks on x [B, S, D], each one of a GEMM with a random epilogue (activations; + - * /
with a number, a row, a column, a full tensor or a 0-d tensor), a SwiGLU MLP, the stabilized
parallel mLSTM behind q/k/v projections in a random spelling (mask, fill, max, scale, einsums,
normalizer; the xlstm package's parallel_stabilized_simple, called or written out), an sLSTM loop
over time, a causal depthwise conv or a per-head group norm. It is exported by
torch_xaccel.onnx.export with Dim("batch") (and Dim("seq") where no block fixes the sequence) and
run in onnxruntime (CPU) at the example's sizes and at others, compared with eager PyTorch at both
(fp32, 1e-4 norm-wise); the file's output must keep its dynamic dims by name, no pass may fix one
(the export would leave that pass out and say so), and the xaccel schemas' shape inference must
give onnxruntime's shapes at the other size."""
from __future__ import annotations

import random
import textwrap
from dataclasses import dataclass

import torch

from tests.helpers import inferred_shapes_match_onnxruntime, onnxruntime_outputs, rel_err

TOL = 1e-4
UNARY = ["torch.relu({})", "F.gelu({})", "F.gelu({}, approximate='tanh')", "F.silu({})", "torch.sigmoid({})",
         "torch.tanh({})"]
MASKS = {  # (the mask, the fill of logD's future positions)
    "tril_masked_fill": ("torch.tril(torch.ones(S, S, dtype=torch.bool))", "logD.masked_fill(~mask, float('-inf'))"),
    "triu_masked_fill": ("torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)",
                         "logD.masked_fill(mask, -math.inf)"),
    "tril_where": ("torch.ones(S, S, dtype=torch.bool).tril()", "torch.where(mask, logD, float('-inf'))"),
    "tril_where_tensor": ("torch.tril(torch.ones(S, S, dtype=torch.bool))",
                          "torch.where(mask, logD, torch.tensor(float('-inf')))"),
    "float_eq_zero": ("torch.ones(S, S).tril()", "logD.masked_fill(mask == 0, float('-inf'))"),
}
MAXES = ["m = logD.amax(-1, keepdim=True)", "m = torch.max(logD, -1, keepdim=True).values",
         "m = logD.max(-1, keepdim=True)[0]", "m, _ = torch.max(logD, dim=-1, keepdim=True)"]
SCALES = {  # the 1/sqrt(DH) scale of q k^T, and where it goes
    "qk": "(q @ k.transpose(-2, -1)) / math.sqrt(DH) * torch.exp(logD - m)",
    "k": "q @ (k * DH ** -0.5).transpose(-2, -1) * torch.exp(logD - m)",
    "after": "(q @ k.transpose(-1, -2)) * torch.exp(logD - m) * DH ** -0.5",
}
EINSUM_SCALE = "torch.einsum('bhtd,bhsd->bhts', q, k) * torch.exp(logD - m) * DH ** -0.5"
LIBRARY_COPY = [  # the xlstm package's parallel_stabilized_simple written out: cumsum from a zero row, repeat
    "lf = torch.cat([torch.zeros(B, q.shape[1], 1, 1), torch.cumsum(F.logsigmoid(f[..., None]), dim=-2)], dim=-2)",
    "rep = lf.repeat(1, 1, 1, S + 1)",
    "mask = torch.tril(torch.ones(S, S, dtype=torch.bool))",
    "logD = torch.where(mask, (rep - rep.transpose(-2, -1))[:, :, 1:, 1:], -float('inf')) + i[..., None, :]",
    "m, _ = torch.max(logD, dim=-1, keepdim=True)",
    "C = (q @ (k / math.sqrt(DH)).transpose(-2, -1)) * torch.exp(logD - m)",
    "h = (C / (torch.maximum(C.sum(dim=-1, keepdim=True).abs(), torch.exp(-m)) + 1e-6)) @ v"]


@dataclass
class Case:
    seed: int
    source: str  # `class Model(nn.Module)`
    blocks: list[str]  # the block kinds, in order
    d: int
    seq: int
    dynamic_seq: bool
    sizes: tuple[tuple[int, int], ...]  # (batch, seq) of each onnxruntime run; the first is the example's

    def model(self) -> torch.nn.Module:
        env: dict = {}
        exec(compile(self.source, f"<onnx fuzz case {self.seed}>", "exec"), env)
        torch.manual_seed(self.seed)
        return env["Model"]().eval()

    def inputs(self, batch: int, seq: int) -> torch.Tensor:
        return torch.randn(batch, seq, self.d, generator=torch.Generator().manual_seed(self.seed + batch * 101 + seq))

    def dynamic_shapes(self) -> tuple:
        dims = {0: torch.export.Dim("batch")}
        if self.dynamic_seq:
            dims[1] = torch.export.Dim("seq")
        return (dims,)

    def reproducer(self) -> str:
        return textwrap.dedent(f"""\
            # onnx fuzz case {self.seed}: blocks {self.blocks}, D={self.d}, runs at (batch, seq) {self.sizes},
            # Dim("seq") {'too' if self.dynamic_seq else 'not declared'}
            {textwrap.indent(self.source, '            ').strip()}
            from tests.onnx_fuzz import check, generate
            print(check(generate({self.seed})))
            """)


class _Writer:
    """A module's __init__ and forward lines, with unique names per block."""

    def __init__(self, rng: random.Random, d: int):
        self.rng, self.d = rng, d
        self.init: list[str] = []
        self.body: list[str] = []
        self.k = 0

    def name(self, stem: str) -> str:
        self.k += 1
        return f"{stem}{self.k}"

    def param(self, stem: str, shape: tuple, scale: float = 1.0) -> str:
        p = self.name(stem)
        self.init.append(f"self.{p} = nn.Parameter(torch.randn({shape}) * {scale:.4g})")
        return f"self.{p}"

    def linear(self, n_in: int, n_out: int, bias: bool = True) -> str:
        p = self.name("lin")
        self.init.append(f"self.{p} = nn.Linear({n_in}, {n_out}, bias={bias})")
        return f"self.{p}"


def _operand(w: _Writer, n: int, divisor: bool) -> str:
    """What an epilogue combines with: a number, a 0-d tensor, a row, a column or a full tensor of
    the block's input x (the batch and sequence sizes follow x's)."""
    rng = w.rng
    kind = rng.choice(["number", "zero_d", "zero_d_param", "row", "col", "full"])
    if kind == "number":
        return repr(rng.choice([-1.5, 0.5, 2.0, 3]))
    if kind == "zero_d":
        return f"torch.tensor({rng.choice([0.75, 2.0, -1.25])})"
    if kind == "zero_d_param":
        source = w.param("s", (), 1.0)
    elif kind == "row":
        source = w.param("r", (n,), 1.0)
    else:
        source = "x.mean(-1, keepdim=True)" if kind == "col" else f"x[..., :{n}]"
    return f"({source}.abs() + 0.5)" if divisor else source


def _gemm(w: _Writer) -> None:
    rng, d = w.rng, w.d
    n = rng.choice([d, d // 2])
    form = rng.choice(["linear", "matmul", "at", "F.linear"])
    if form == "linear":
        y = f"{w.linear(d, n, rng.random() < 0.5)}(x)"
    elif form == "F.linear":
        y = f"F.linear(x, {w.param('w', (n, d), d ** -0.5)}, {w.param('b', (n,), 0.1)})"
    else:
        wt = w.param("w", (d, n), d ** -0.5)
        y = f"torch.matmul(x, {wt})" if form == "matmul" else f"x @ {wt}"
    w.body.append(f"y = {y}")
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.4:
            w.body.append(f"y = {rng.choice(UNARY).format('y')}")
        else:
            op = rng.choice("+-*/")
            other = _operand(w, n, op == "/")
            w.body.append(f"y = {other} {op} y" if op in "+*" and rng.random() < 0.3 else f"y = y {op} {other}")
    back = f"{w.linear(n, d, False)}(y)" if n != d else "y"
    w.body.append(f"x = {back} + x")


def _swiglu(w: _Writer) -> None:
    d = w.d
    w1, w3, w2 = w.linear(d, 2 * d, False), w.linear(d, 2 * d, False), w.linear(2 * d, d, False)
    w.body.append(f"x = {w2}(F.silu({w1}(x)) * {w3}(x)) + x")


def _mlstm(w: _Writer) -> None:
    rng, d = w.rng, w.d
    heads = rng.choice([1, 2])
    q, k, v = (w.linear(d, d) for _ in range(3))
    gi, gf = w.linear(d, heads), w.linear(d, heads)
    w.body += [f"q, k, v = (p(x).view(B, S, {heads}, -1).transpose(1, 2) for p in ({q}, {k}, {v}))",
               f"i, f = {gi}(x).transpose(1, 2), {gf}(x).transpose(1, 2) + 2", "DH = q.shape[-1]"]
    form = rng.choice(["paper", "paper", "paper", "library", "library_copy"])
    if form == "library":
        w.body.append("h = parallel_stabilized_simple(q, k, v, i[..., None], f[..., None])")
    elif form == "library_copy":
        w.body += LIBRARY_COPY
    else:
        mask, fill = MASKS[rng.choice(list(MASKS))]
        einsum = rng.random() < 0.2
        w.body += [rng.choice(["Fc = torch.cumsum(F.logsigmoid(f), dim=-1)", "Fc = F.logsigmoid(f).cumsum(-1)"]),
                   rng.choice(["logD = Fc[..., :, None] - Fc[..., None, :] + i[..., None, :]",
                               "logD = Fc.unsqueeze(-1) - Fc.unsqueeze(-2) + i.unsqueeze(-2)"]),
                   f"mask = {mask}", f"logD = {fill}", rng.choice(MAXES),
                   f"C = {EINSUM_SCALE if einsum else SCALES[rng.choice(list(SCALES))]}",
                   f"n = torch.maximum(C.sum(-1, keepdim=True).abs(), torch.exp(-m)){rng.choice(['', ' + 1e-6'])}",
                   "h = torch.einsum('bhts,bhsd->bhtd', C / n, v)" if einsum else "h = (C / n) @ v"]
    w.body.append(f"x = {w.linear(d, d, False)}(h.transpose(1, 2).reshape(B, S, {d})) + x")


def _slstm(w: _Writer) -> None:
    """The demo's sLSTM loop over time (it fixes the sequence length)."""
    d, heads = w.d, 2
    wx, R = w.linear(d, 4 * d), w.param("R", (heads, 4 * (d // heads), d // heads), (d // heads) ** -0.5)
    w.body += [f"wx = {wx}(x).view(B, S, 4, {heads}, {d // heads})",
               f"h = c = n = m = torch.zeros(B, {heads}, {d // heads})",
               "ys = []",
               "for t in range(S):",
               f"    raw = wx[:, t] + torch.einsum('bhk,hjk->bhj', h, {R}).view(B, {heads}, 4, -1).transpose(1, 2)",
               "    ig, fg, z, o = raw.unbind(1)",
               "    logfm = m + F.logsigmoid(fg)",
               "    m_new = torch.where(n == 0, ig, torch.maximum(ig, logfm))",
               "    ie, fe = torch.exp(ig - m_new), torch.exp(logfm - m_new)",
               "    c = fe * c + ie * torch.tanh(z)",
               "    n = fe * n + ie",
               "    h, m = torch.sigmoid(o) * c / n, m_new",
               "    ys.append(h)",
               f"x = torch.stack(ys, 1).reshape(B, S, {d}) + x"]


def _causal_conv(w: _Writer) -> None:
    d, K = w.d, w.rng.choice([2, 3, 4])
    cw, cb = w.param("cw", (d, 1, K), 0.5), w.param("cb", (d,), 0.1)
    if w.rng.random() < 0.5:
        conv = f"F.conv1d(x.transpose(1, 2), {cw}, {cb}, padding={K - 1}, groups={d})[..., :S]"
    else:
        conv = f"F.conv1d(F.pad(x.transpose(1, 2), ({K - 1}, 0)), {cw}, {cb}, groups={d})"
    w.body.append(f"x = F.silu({conv}.transpose(1, 2)) + x")


def _group_norm(w: _Writer) -> None:
    d, groups = w.d, w.rng.choice([2, 4])
    gw, gb = w.param("gw", (d,), 1.0), w.param("gb", (d,), 0.1)
    w.body.append(f"x = F.group_norm(x.reshape(-1, {d}), {groups}, {gw}, {gb}).view(B, S, {d}) + x")


BLOCKS = {"gemm": _gemm, "swiglu": _swiglu, "mlstm": _mlstm, "slstm": _slstm, "causal_conv": _causal_conv,
          "group_norm": _group_norm}


def generate(seed: int) -> Case:
    rng = random.Random(seed)
    d = rng.choice([8, 16, 32])
    kinds = rng.sample(list(BLOCKS), rng.randint(1, 2))
    if rng.random() < 0.3 and "gemm" not in kinds:
        kinds.append("gemm")
    w = _Writer(rng, d)
    for kind in kinds:
        BLOCKS[kind](w)
    seq = rng.choice([4, 6, 9])
    dynamic_seq = "slstm" not in kinds and rng.random() < 0.5
    other_seq = rng.choice([s for s in (3, 5, 11) if s != seq]) if dynamic_seq else seq
    sizes = ((2, seq), (rng.choice([1, 3, 5]), other_seq))
    init = "\n".join(f"        {line}" for line in w.init)
    body = "\n".join(f"        {line}" for line in w.body)
    library = ("from xlstm.blocks.mlstm.backends import parallel_stabilized_simple\n"
               if "parallel_stabilized_simple" in body else "")
    source = ("import math\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
              f"{library}\n\nclass Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
              f"{init}\n\n    def forward(self, x):\n        B, S, _ = x.shape\n{body}\n        return x\n")
    return Case(seed, source, kinds, d, seq, dynamic_seq, sizes)


def _fixed_output_dims(model, case: Case) -> list[str]:
    """The output's dims that should follow a declared Dim but are numbers."""
    dims = model.graph.output[0].type.tensor_type.shape.dim
    names = {0: "batch", 1: "seq"} if case.dynamic_seq else {0: "batch"}
    return [f"{names[a]} is {dims[a].dim_value}" for a in names if dims[a].HasField("dim_value")]


def _export_problem(case: Case, model, path) -> str | None:
    """Why the export failed or fixed a declared dim (a pass guarding on a size it must keep
    symbolic is a failure even though the export then leaves that pass out), or None."""
    from torch_xaccel import onnx as xonnx

    try:
        res = xonnx.export(model, (case.inputs(*case.sizes[0]),), path, dynamic_shapes=case.dynamic_shapes(),
                           report=False)
    except Exception as e:  # noqa: BLE001 - the failure is the result
        return f"export failed: {type(e).__name__}: {str(e)[:1500]}"
    fixed = _fixed_output_dims(res.model, case)
    if fixed:
        return f"the output's declared dims are fixed: {', '.join(fixed)}; xaccel nodes {res.nodes()}"
    left_out = [f.reason for f in res.report.fallbacks if "declared dynamic, would be fixed" in f.reason]
    return "; ".join(left_out) or None


def _run_problem(case: Case, model, path) -> str | None:
    """Where onnxruntime differs from eager, or fails, at one of the case's sizes, or the xaccel
    schemas' shape inference differs from onnxruntime's shapes at the other size; or None."""
    import onnx

    try:
        inferred_shapes_match_onnxruntime(onnx.load(path), case.inputs(*case.sizes[-1]))
    except AssertionError as e:
        return f"inferred shapes at (batch, seq) {case.sizes[-1]}: {e}"
    for batch, seq in case.sizes:
        x = case.inputs(batch, seq)
        with torch.no_grad():
            want = model(x)
        try:
            (got,) = onnxruntime_outputs(path, x)
        except Exception as e:  # noqa: BLE001 - the failure is the result
            return f"onnxruntime at batch {batch}, seq {seq}: {type(e).__name__}: {str(e)[:1500]}"
        if got.shape != want.shape or rel_err(got, want) > TOL:
            return (f"batch {batch}, seq {seq}: shape {tuple(got.shape)} (eager {tuple(want.shape)}), "
                    f"error {rel_err(got, want):.2e}")
    return None


def check(case: Case) -> str | None:
    """None when the export keeps its declared dims and onnxruntime equals eager at every size,
    else what went wrong."""
    import tempfile

    model = case.model()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/case{case.seed}.onnx"
        return _export_problem(case, model, path) or _run_problem(case, model, path)
