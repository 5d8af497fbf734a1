"""ONNX exports keep Dim("batch") (and Dim("seq") where the model allows) symbolic: onnxruntime runs
the file at other sizes and equals eager. A GEMM with a 0-d operand exports; the paper's mLSTM
spellings and the xlstm package's parallel_stabilized_simple keep the batch in every shape and
body; a pass that fixes a declared dim is left out of the export and reported, and a reference
that fixes one is a clear error. The random models of tests/onnx_fuzz.py: CI runs a fixed budget
of seeds; XACCEL_FUZZ_CASES=N runs N (XACCEL_FUZZ_START the first seed)."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import fuzz_batch, fuzz_budget, onnxruntime_outputs, rel_err
from tests.onnx_fuzz import BLOCKS, check, generate

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
xonnx = pytest.importorskip("torch_xaccel.onnx")

BATCH = torch.export.Dim("batch")


def _runs_at_other_batch_sizes(model, path, x, *, tol=1e-5) -> None:
    """onnxruntime equals eager at x's batch and at two others; the output's batch is a name."""
    import onnx

    assert onnx.load(str(path)).graph.output[0].type.tensor_type.shape.dim[0].dim_param
    for batch in (x.shape[0], 1, 3):
        xb = torch.randn(batch, *x.shape[1:])
        with torch.no_grad():
            want = model(xb)
        (got,) = onnxruntime_outputs(path, xb)
        assert got.shape == want.shape and rel_err(got, want) <= tol, (batch, rel_err(got, want))


class ZeroDim(torch.nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.form, self.w = form, torch.nn.Parameter(torch.randn(16, 8) / 4)
        self.s = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        if self.form == "tensor":
            return x @ self.w * torch.tensor(2.0)
        return torch.relu(x @ self.w + self.s) / self.s


@pytest.mark.parametrize("form", ["tensor", "parameter"])
def test_a_gemm_with_a_0d_operand_exports_as_one_node(tmp_path, form):
    """The 0-d operand's example is a 0-d tensor (it was `randn()` of no sizes: a TypeError)."""
    torch.manual_seed(0)
    model, x, path = ZeroDim(form).eval(), torch.randn(2, 5, 16), tmp_path / "zero_d.onnx"
    res = xonnx.export(model, (x,), path, dynamic_shapes=({0: BATCH},), report=False)
    assert res.xaccel_nodes == {"gemm_epilogue": 1}
    _runs_at_other_batch_sizes(model, path, x)


def _where(q, k, v, i, f):
    """The paper's form, its mask applied by torch.where."""
    S, D = q.shape[-2:]
    Fc = torch.cumsum(F.logsigmoid(f), dim=-1)
    logD = Fc[:, :, :, None] - Fc[:, :, None, :] + i[:, :, None, :]
    logD = torch.where(torch.tril(torch.ones(S, S, dtype=torch.bool)), logD, float("-inf"))
    m = torch.max(logD, -1, keepdim=True).values
    C = (q @ k.transpose(-1, -2)) / math.sqrt(D) * torch.exp(logD - m)
    return (C / torch.maximum(C.sum(-1, keepdim=True).abs(), torch.exp(-m))) @ v


def _library_copy(q, k, v, i, f):
    """xlstm's parallel_stabilized_simple written out: the cumsum from a zero row, repeated."""
    B, H, S, D = q.shape
    lf = torch.cat([torch.zeros(B, H, 1, 1), torch.cumsum(F.logsigmoid(f[..., None]), dim=-2)], dim=-2)
    rep = lf.repeat(1, 1, 1, S + 1)
    logD = torch.where(torch.tril(torch.ones(S, S, dtype=torch.bool)), (rep - rep.transpose(-2, -1))[:, :, 1:, 1:],
                       -float("inf")) + i[..., None].transpose(-2, -1)
    m, _ = torch.max(logD, dim=-1, keepdim=True)
    C = (q @ (k / math.sqrt(D)).transpose(-2, -1)) * torch.exp(logD - m)
    return (C / (torch.maximum(C.sum(dim=-1, keepdim=True).abs(), torch.exp(-m)) + 1e-6)) @ v


def _library(q, k, v, i, f):
    from xlstm.blocks.mlstm.backends import parallel_stabilized_simple

    return parallel_stabilized_simple(q, k, v, i[..., None], f[..., None])


SPELLINGS = {"where": _where, "library_copy": _library_copy, "library": _library}


class PaperMLSTM(torch.nn.Module):
    """A GEMM chain on the input (its node reads the graph's batch and a slice of the input),
    then an mLSTM behind q/k/v projections in one of SPELLINGS."""

    def __init__(self, spelling: str, d: int = 32, heads: int = 2):
        super().__init__()
        self.mlstm, self.heads = SPELLINGS[spelling], heads
        self.up, self.out = torch.nn.Linear(d, d), torch.nn.Linear(d, d, bias=False)
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.i, self.f = torch.nn.Linear(d, heads), torch.nn.Linear(d, heads)

    def forward(self, x):
        B, S, d = x.shape
        x = F.gelu(self.up(x)) * x[..., :d]
        q, k, v = (p(x).view(B, S, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        h = self.mlstm(q, k, v, self.i(x).transpose(1, 2), self.f(x).transpose(1, 2) + 2)
        return self.out(h.transpose(1, 2).reshape(B, S, d)) + x


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_the_paper_mlstm_spellings_keep_the_batch_symbolic(tmp_path, spelling):
    """The mLSTM (one node where matched) and the GEMM chain keep the batch in their shapes and
    bodies (the numeric proof fixed it once: a Reshape to [2, ...] in the mlstm body, or a GEMM
    body traced with the graph's batch against a fixed one); no pass fixes the dim."""
    if spelling == "library":
        pytest.importorskip("xlstm")
    torch.manual_seed(0)
    model, x, path = PaperMLSTM(spelling).eval(), torch.randn(2, 6, 32), tmp_path / f"{spelling}.onnx"
    res = xonnx.export(model, (x,), path, dynamic_shapes=({0: BATCH},), report=False)
    _runs_at_other_batch_sizes(model, path, x)
    assert not [f for f in res.report.fallbacks if "declared dynamic" in f.reason]
    assert res.xaccel_nodes.get("gemm_epilogue")
    if spelling != "library_copy":  # (whether the numeric proof takes the written-out copy is its own matter)
        assert res.xaccel_nodes.get("mlstm") == 1


class GeluMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.down(F.gelu(self.up(x))) + x


def _a_pass_that_fixes_the_batch(monkeypatch, filename: str) -> None:
    """The gemm_epilogue pass, led by an int() of the graph's batch written in `filename`: a
    guard that fixes the dim, as the mLSTM's numeric proof once did."""
    from torch_xaccel.lowering.gemm_epilogue import chains

    source = ("def fix(gm):\n"
              "    x = next(n for n in gm.graph.nodes if n.op == 'placeholder' and n.name == 'x')\n"
              "    return int(x.meta['val'].shape[0])\n")
    env: dict = {}
    exec(compile(source, filename, "exec"), env)
    run = chains.run

    def fixing(gm, ctx):
        env["fix"](gm)
        return run(gm, ctx)
    monkeypatch.setattr(chains, "run", fixing)


@pytest.mark.parametrize("where", ["family", "elsewhere"])
def test_a_pass_that_fixes_a_declared_dim_is_left_out_and_reported(tmp_path, monkeypatch, where):
    """The export lowers again without the family whose pass fixed the dim (every pass, where the
    guard is not in a family's lowering), says which dim, to what and where, and the file keeps
    the batch symbolic."""
    import torch_xaccel.lowering as lowering

    folder = os.path.dirname(os.path.abspath(lowering.__file__))
    filename = os.path.join(folder, "gemm_epilogue", "guard.py") if where == "family" else "/elsewhere/guard.py"
    _a_pass_that_fixes_the_batch(monkeypatch, filename)
    torch.manual_seed(0)
    model, x, path = GeluMLP().eval(), torch.randn(2, 5, 16), tmp_path / "fixed.onnx"
    res = xonnx.export(model, (x,), path, dynamic_shapes=({0: BATCH},), report=False)
    assert res.xaccel_nodes == {}
    reasons = [(f.family, f.reason) for f in res.report.fallbacks if "declared dynamic" in f.reason]
    family, by, site, left_out = (
        ("gemm_epilogue", "the gemm_epilogue pass", "lowering/gemm_epilogue/guard.py:3", "the gemm_epilogue patterns")
        if where == "family" else ("backend", "a pass", "guard.py:3", "the passes"))
    assert reasons == [(family, f"dim 0 of input x, declared dynamic, would be fixed to 2 by {by} ({site}): exported "
                                f"without {left_out} (that code as standard ONNX), so the file keeps the dim symbolic")]
    assert not res.report.replacements
    _runs_at_other_batch_sizes(model, path, x)


def test_a_reference_that_fixes_a_dynamic_dim_is_a_clear_error():
    """torch.onnx keeps the input's dim name but writes the sizes after it as numbers: a body
    that would run only at the example's size is refused, naming the dim."""
    from torch_xaccel.onnx.functions import reference_graph

    class Branches(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.shape[0] == 3 else x + 1

    with pytest.raises(ValueError, match=r"the reference \(Branches\) fixes dim 0 of its input 0 to 3: its ONNX body "
                                         r"would run only at that size"):
        reference_graph(Branches(), (torch.randn(3, 5),), ({0: torch.export.Dim("b")},), 18)


CI_CASES = 6
START, CASES = fuzz_budget(CI_CASES)
FUZZ_BATCH = 3


@pytest.mark.parametrize("first", range(START, START + CASES, FUZZ_BATCH))
def test_random_models_export_with_a_dynamic_batch_and_match_eager(first):
    fuzz_batch(range(first, min(first + FUZZ_BATCH, START + CASES)), generate, check, lambda c: c.reproducer())


def test_the_generator_covers_what_it_promises():
    """The generator writes every form it promises (a fuzzer that stopped writing 0-d operands
    or the mLSTM spellings the numeric proof takes would prove nothing), and CI's budget holds
    an mLSTM, a GEMM chain with a 0-d operand, the xlstm package's form and an sLSTM loop."""
    cases = [generate(seed) for seed in range(200)]
    sources = "\n".join(c.source for c in cases)
    for needle in ("torch.tensor(", "torch.randn(())", "parallel_stabilized_simple(", "rep.transpose(-2, -1)",
                   "torch.tensor(float('-inf'))", "mask == 0", "m, _ = torch.max", "torch.einsum('bhtd",
                   "F.group_norm(", "F.conv1d(F.pad(", "padding=", "for t in range(S)", "F.silu(self.lin"):
        assert needle in sources, needle
    assert {k for c in cases for k in c.blocks} == set(BLOCKS)
    assert {c.dynamic_seq for c in cases} == {False, True} and {c.sizes[1][0] for c in cases} == {1, 3, 5}
    assert {"mlstm", "gemm", "slstm"} <= {k for c in cases[:CI_CASES] for k in c.blocks}
    budget = "\n".join(c.source for c in cases[:CI_CASES])
    for needle in ("torch.tensor(", "parallel_stabilized_simple(", "rep.transpose(-2, -1)"):
        assert needle in budget, needle
