"""The epilogue IR: JSON round trip, validation, and its reference vjp against autograd (float64)."""
import random

import pytest
import torch

from tests.helpers import rel_err
from torch_xaccel.ops.gemm_epilogue.epilogue_ir import BINARY, UNARY, Epilogue, evaluate, needed_by_vjp, vjp


def random_chain(rng: random.Random, n_ops: int) -> Epilogue:
    """acc + bias, then random unary/binary steps against constants, operands or earlier values."""
    nodes = [{"op": "acc", "index": 0}, {"op": "load", "operand": 0, "bcast": "row"}, {"op": "add", "in": [0, 1]}]

    def add(node):
        nodes.append(node)
        return len(nodes) - 1

    cur = 2
    for _ in range(n_ops):
        if rng.random() < 0.4:
            cur = add({"op": rng.choice(UNARY), "in": [cur]})
            continue
        kind = rng.choice(["const", "full", "col", "earlier"])
        if kind == "const":
            other = add({"op": "const", "value": rng.uniform(0.5, 2.0)})
        elif kind == "earlier":
            other = add({"op": "tanh", "in": [rng.choice([i for i in range(cur + 1) if nodes[i]["op"] != "const"])]})
        else:
            other = add({"op": "load", "operand": 1 if kind == "full" else 2, "bcast": kind})
        op = rng.choice(BINARY)
        if op == "div" and kind != "const":  # keep the divisor in (1, 2)
            other = add({"op": "add", "in": [add({"op": "sigmoid", "in": [other]}),
                                             add({"op": "const", "value": 1.0})]})
        if op == "div" or rng.random() < 0.5:
            args = [cur, other]
        else:
            args = [other, cur]
        cur = add({"op": op, "in": args})
    return Epilogue(tuple(nodes), (cur, 2))


def test_json_round_trip_and_canonical():
    ep = random_chain(random.Random(0), 6)
    text = ep.to_json()
    assert Epilogue.from_json(text) == ep and Epilogue.from_json(text).to_json() == text


@pytest.mark.parametrize("bad", [
    {"v": 1, "nodes": [{"op": "acc", "index": 0}, {"op": "relu", "in": [1]}], "outputs": [1]},   # forward ref
    {"v": 1, "nodes": [{"op": "acc", "index": 0}, {"op": "exp", "in": [0]}], "outputs": [1]},    # unknown op
    {"v": 1, "nodes": [{"op": "load", "operand": 0, "bcast": "diag"}], "outputs": [0]},          # bad bcast
    {"v": 1, "nodes": [{"op": "acc", "index": 0}], "outputs": [3]},                              # bad output
    {"v": 2, "nodes": [], "outputs": []},                                                         # version
])
def test_validation_rejects_malformed(bad):
    import json

    with pytest.raises(ValueError):
        Epilogue.from_json(json.dumps(bad))


@pytest.mark.parametrize("seed", range(12))
def test_vjp_matches_autograd_float64(seed):
    rng = random.Random(seed)
    ep = random_chain(rng, rng.randrange(1, 7))
    torch.manual_seed(seed)
    M, N = 7, 5
    acc = torch.randn(M, N, dtype=torch.float64, requires_grad=True)
    ops = [torch.randn(N, dtype=torch.float64, requires_grad=True),
           torch.randn(M, N, dtype=torch.float64, requires_grad=True),
           torch.randn(M, 1, dtype=torch.float64, requires_grad=True)]
    vals = evaluate(ep, [acc], ops, dtype=torch.float64)
    outs = [vals[o] for o in ep.outputs]
    cot = [torch.randn(M, N, dtype=torch.float64) for _ in outs]
    want = torch.autograd.grad(sum((o * c).sum() for o, c in zip(outs, cot)), [acc, *ops], allow_unused=True)
    with torch.no_grad():
        acc_g, op_g = vjp(ep, evaluate(ep, [acc], ops, dtype=torch.float64, only=needed_by_vjp(ep)), cot, torch.float64)
    got = [acc_g.get(0)] + [op_g[j].sum_to_size(t.shape) if j in op_g else None for j, t in enumerate(ops)]
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert g.dtype == torch.float64
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_describe_is_readable():
    ep = Epilogue(({"op": "acc", "index": 0}, {"op": "load", "operand": 0, "bcast": "row"},
                   {"op": "add", "in": [0, 1]}, {"op": "gelu_tanh", "in": [2]}), (3,))
    assert ep.describe() == "add(row) -> gelu_tanh"


@pytest.mark.parametrize("seed", range(4))
def test_aten_composition_is_the_reference_up_to_input_dtype_rounding(seed):
    """The path the runtime takes where ATen wins the timing: exactly the reference in fp32; in
    bf16 within 2e-2 of the fp64 reference over random chains (eager's own rounding per node: a
    few bf16 ulps, 2^-8 each, along chains of up to 7 steps)."""
    from torch_xaccel.ops.gemm_epilogue.reference import aten_composition, forward as reference

    rng = random.Random(seed)
    torch.manual_seed(seed)
    ep = random_chain(rng, 5)
    M, K, N = 48, 64, 40
    a, b = torch.randn(M, K) / 8, torch.randn(N, K)
    ops = [torch.randn(N), torch.randn(M, N), torch.randn(M, 1)]
    text = ep.to_json()
    got32 = aten_composition(a, [b], ops, text, True)
    want32 = reference(a, [b], ops, text, True)
    assert all(torch.equal(g, w) for g, w in zip(got32, want32))
    want = reference(a.double(), [b.double()], [o.double() for o in ops], text, True)
    got = aten_composition(a.bfloat16(), [b.bfloat16()], [o.bfloat16() for o in ops], text, True)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        assert ((g.double() - w).norm() / w.norm()).item() <= 2e-2


def test_aten_composition_keeps_a_0d_fp32_scalar_as_eager_does():
    """x_bf16 * tensor(0.1234567): eager multiplies by the fp32 scalar, so the composition must
    not round it to bf16 first (that changes many elements)."""
    from torch_xaccel.ops.gemm_epilogue.reference import aten_composition

    torch.manual_seed(0)
    ep = Epilogue(({"op": "acc", "index": 0}, {"op": "load", "operand": 0, "bcast": "scalar"},
                   {"op": "mul", "in": [0, 1]}), (2,))
    a, b = torch.randn(40, 64).bfloat16(), torch.randn(64, 50).bfloat16()
    scale = torch.tensor(0.1234567)
    got = aten_composition(a, [b], [scale], ep.to_json(), False)[0]
    assert torch.equal(got, torch.matmul(a, b) * scale)


ACC, ROW, FULL = ({"op": "acc", "index": 0}, {"op": "load", "operand": 0, "bcast": "row"},
                  {"op": "load", "operand": 1, "bcast": "full"})


@pytest.mark.parametrize("lead,bt", [((), True), ((3,), False)])
def test_aten_composition_folds_a_bias_or_residual_add_into_addmm(lead, bt):
    """The add right after the GEMM goes into cuBLAS (torch.addmm), where the accumulator has no
    other reader: the result stays within bf16 rounding of the fp64 reference, and the fold is
    refused where the accumulator is read twice or is itself an output."""
    from torch_xaccel.ops.gemm_epilogue.reference import _addmm_folds, aten_composition, forward as reference

    torch.manual_seed(len(lead))
    M, K, N = 33, 48, 40
    a = torch.randn(*lead, M, K)
    b = torch.randn(N, K) if bt else torch.randn(K, N)
    ops = [torch.randn(N), torch.randn(*lead, M, N)]
    chains = [  # (epilogue, the fold it should get)
        ((ACC, ROW, {"op": "add", "in": [0, 1]}, {"op": "gelu_tanh", "in": [2]}, FULL, {"op": "add", "in": [3, 4]}),
         {0: (2, 0, "row")}),
        ((ACC, FULL, {"op": "add", "in": [1, 0]}, {"op": "relu", "in": [2]}), {0: (2, 1, "full")}),
        ((ACC, ROW, {"op": "add", "in": [0, 1]}, {"op": "mul", "in": [0, 2]}), {}),  # acc read twice
    ]
    for nodes, fold in chains:
        ep = Epilogue(nodes, (len(nodes) - 1,))
        lo = [o.bfloat16() for o in ops]
        assert _addmm_folds(ep, a.bfloat16(), [b.bfloat16()], lo) == fold
        got = aten_composition(a.bfloat16(), [b.bfloat16()], lo, ep.to_json(), bt)[0]
        want = reference(a.double(), [b.double()], [o.double() for o in ops], ep.to_json(), bt)[0]
        assert got.shape == want.shape and rel_err(got, want) <= 1e-2
    out_acc = Epilogue((ACC, ROW, {"op": "add", "in": [0, 1]}), (2, 0))
    assert _addmm_folds(out_acc, a, [b], ops) == {}
