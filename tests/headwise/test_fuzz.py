"""Differential fuzzing of the headwise pass (tests/headwise/fuzz.py). CI runs a fixed budget of
seeds; XACCEL_FUZZ_CASES=N runs N (XACCEL_FUZZ_START the first seed)."""
import pytest

from tests.headwise.fuzz import check, generate
from tests.helpers import fuzz_batch, fuzz_budget

START, CASES = fuzz_budget(60)
BATCH = 20


@pytest.mark.parametrize("first", range(START, START + CASES, BATCH))
def test_random_headwise_einsums_match_eager(first):
    fuzz_batch(range(first, min(first + BATCH, START + CASES)), generate, check, repr)
