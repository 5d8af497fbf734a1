import os

import pytest
import torch

# Tests must not depend on the developer's shell; each sets the switches it exercises. The fuzz
# tests' budget (XACCEL_FUZZ_CASES, XACCEL_FUZZ_START) is not a backend switch and stays.
for _name in [k for k in os.environ if k.startswith("XACCEL_") and not k.startswith("XACCEL_FUZZ_")]:
    del os.environ[_name]
# The measured choice (choice.py) builds Inductor candidates and times them at each graph's first
# call: the suite checks what the replacements compute with it off, and tests/test_choice.py
# turns it on for the choice itself.
os.environ["XACCEL_CHOOSE"] = "0"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def xaccel_env(monkeypatch):
    """Set XACCEL_* variables for one test."""
    def set_env(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, v)
    return set_env
