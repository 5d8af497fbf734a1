"""Differential fuzzing of the mLSTM parallel form (tests/mlstm/fuzz.py): random styles of the
formula, shapes and slips, compiled with the xaccel backend, must equal eager in forward and
gradients, be replaced exactly when they are the op's form, and never when a slip makes them
another function.

CI runs a fixed budget of seeds; XACCEL_FUZZ_CASES=N runs N (XACCEL_FUZZ_START the first seed)."""
import pytest

from tests.helpers import fuzz_batch, fuzz_budget
from tests.mlstm.fuzz import check, check_op, generate, generate_op

START, CASES = fuzz_budget(100)
BATCH = 25


@pytest.mark.parametrize("first", range(START, START + CASES, BATCH))
def test_random_mlstm_forms_match_eager(first):
    fuzz_batch(range(first, min(first + BATCH, START + CASES)), generate, check,
               lambda c: f"{c.source}\n{c.shapes}, {c.mode}, dynamic={c.dynamic}")


@pytest.mark.parametrize("first", range(START, START + CASES, BATCH))
def test_the_op_with_random_states_shapes_and_gates_matches_its_formula(first):
    fuzz_batch(range(first, min(first + BATCH, START + CASES)), generate_op, check_op, repr)


def test_a_wrong_scale_is_not_proven_equal():
    """q k^T / DQK instead of / sqrt(DQK): the row-sum normalizer cancels a constant factor, so a
    proof on inputs where it binds cannot tell the two apart; the proof also runs where the floor
    exp(-m) binds, and the slip stays as written."""
    case = next(c for c in map(generate, range(1000)) if "/ D)" in c.source and "(k / D)" in c.source)
    assert not case.exact_form and check(case) is None
