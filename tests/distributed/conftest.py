import pytest


@pytest.fixture(scope="session")
def reference():
    """One process, one step over the global batch (tests/distributed/harness.py)."""
    from tests.distributed import harness

    return harness.reference()
