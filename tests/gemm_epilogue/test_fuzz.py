"""Differential fuzzing of the gemm_epilogue family against eager (tests/gemm_epilogue/fuzz.py):
random GEMM + elementwise programs and the code around them, compiled with the xaccel backend,
must give eager's outputs, gradients, input mutations, requires_grad flags and errors.

CI runs a fixed budget of seeds; XACCEL_FUZZ_CASES=N runs N (XACCEL_FUZZ_START the first seed).
A failing case prints its program and how to rerun it alone."""
import pytest

from tests.gemm_epilogue.fuzz import check, generate
from tests.helpers import fuzz_batch, fuzz_budget

START, CASES = fuzz_budget(300)
BATCH = 50


@pytest.mark.parametrize("first", range(START, START + CASES, BATCH))
def test_random_programs_match_eager(first):
    fuzz_batch(range(first, min(first + BATCH, START + CASES)), generate, check, lambda c: c.reproducer())


def test_the_generator_covers_what_it_promises():
    """CI's seeds include each kind of case the fuzzer is for (a budget that silently stopped
    generating in-place writes or training cases would prove nothing)."""
    cases = [generate(seed) for seed in range(300)]
    sources = "\n".join(c.source for c in cases)
    for needle in (".mul_(", ".add_(", "linear(x, w, b)", "torch.mm(", "silu(", "transpose(-1, -2)", "- True",
                   "h0 = h", " / ", "[..., :", "v = o"):
        assert needle in sources, needle
    assert {c.mode for c in cases} == {"grad", "no_grad", "inference_mode"}
    assert {c.dynamic for c in cases} == {None, False, True}
    assert {str(c.dtype) for c in cases} == {"torch.float32", "torch.float16", "torch.bfloat16"}
    assert any(c.second_m for c in cases) and any(any(g for _, _, g in c.inputs) for c in cases)
    assert any(c.other_dtypes for c in cases)
