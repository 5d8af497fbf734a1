"""Fault injection: damaged caches, unusable cache directories, concurrent builders and odd inputs.
Each ends in the correct result, with a named fallback or a clear error, and leaves nothing
corrupted behind."""
import multiprocessing
import os
import warnings

import pytest
import torch

import torch_xaccel
from torch_xaccel import runtime
from torch_xaccel.codegen import cache, tuning


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _entry_path(root, key):
    return root / "tuning" / f"{cache.key_name(key)}.json"


@pytest.mark.parametrize("damage", [b"", b'{"key": "k", "value": {"con', b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
                                    b'{"key": "another", "value": {"config": [1]}}', b"[1, 2]"])
def test_a_damaged_tuning_entry_is_tuned_again_and_replaced(cache_dir, damage):
    """Empty, truncated, binary, foreign or malformed: never trusted, tuned again, written whole."""
    path = _entry_path(cache_dir, "k")
    path.parent.mkdir(parents=True)
    path.write_bytes(damage)
    calls = []

    def tune():
        calls.append(1)
        return {"config": [7], "timings": []}

    valid = lambda e: isinstance(e, dict) and e.get("config") == [7]  # noqa: E731
    assert tuning.decide("k", untimed=[0], valid=valid, tune=tune).config == [7]
    assert tuning.decide("k", untimed=[0], valid=valid, tune=tune).config == [7]
    assert calls == [1] and cache.read_entry("tuning", "k") == {"config": [7], "timings": []}


def test_a_directory_in_place_of_an_entry_fails_by_name_and_leaves_no_half_file(cache_dir):
    """A tuning entry that is a directory cannot be replaced: the write raises (a provider's error
    the runtime reports, running the op's reference), and no temporary file is left behind."""
    path = _entry_path(cache_dir, "k")
    path.mkdir(parents=True)
    with pytest.raises(OSError):
        tuning.decide("k", untimed=[0], valid=lambda e: bool(e), tune=lambda: {"config": [1]})
    assert path.is_dir() and not list(path.parent.glob("*.tmp"))


def test_an_impossible_cache_dir_falls_back_with_the_reason(tmp_path, monkeypatch):
    """XACCEL_CACHE_DIR below a file cannot be created: a provider that needs the cache fails, the
    runtime reports it and runs the reference, and the result equals eager's."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("XACCEL_CACHE_DIR", str(blocker / "cache"))

    def needs_the_cache(key, a, *args):
        cache.write_entry("tuning", "probe", {"config": None})
        return NotImplemented

    runtime.register_provider("gemm_epilogue", needs_the_cache)
    try:
        fn = lambda x, w: torch.relu(x @ w.t()) * 2  # noqa: E731
        x, w = torch.randn(5, 3), torch.randn(4, 3)
        torch._dynamo.reset()
        with pytest.warns(torch_xaccel.XaccelFallbackWarning, match="running the ATen reference"):
            out = torch.compile(fn, backend="xaccel")(x, w)
        torch.testing.assert_close(out, fn(x, w))
        assert isinstance(runtime.EVENTS[-1].reason, str) and "Error" in runtime.EVENTS[-1].reason
    finally:
        runtime.unregister_provider("gemm_epilogue", needs_the_cache)


def test_a_read_only_cache_falls_back_and_a_readable_entry_still_serves(cache_dir, monkeypatch):
    """A read-only cache (every write refused, as on a read-only mount; root ignores chmod, so the
    refusal is injected): a decision already stored is still read and used; a new one cannot be
    stored, which raises a clear OSError (the runtime reports it and runs the reference)."""
    cache.write_entry("tuning", "stored", {"config": [3]})

    def refuse(*args, **kwargs):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(cache.tempfile, "mkstemp", refuse)
    valid = lambda e: isinstance(e, dict) and "config" in e  # noqa: E731
    assert tuning.decide("stored", untimed=[0], valid=valid, tune=lambda: {"config": [9]}).config == [3]
    with pytest.raises(PermissionError, match="Read-only"):
        tuning.decide("new", untimed=[0], valid=valid, tune=lambda: {"config": [9]})
    assert cache.read_entry("tuning", "stored") == {"config": [3]}


def _load_same_kernel(root, name):
    os.environ["XACCEL_CACHE_DIR"] = root
    mod = cache.load_source(name, f"VALUE = {sum(range(1000))}\n")
    return mod.VALUE


def test_eight_processes_writing_the_same_kernel_leave_one_whole_source(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(8) as pool:
        values = pool.starmap(_load_same_kernel, [(str(tmp_path), "xaccel_concurrent_probe")] * 8)
    assert values == [sum(range(1000))] * 8
    kernels = tmp_path / "kernels"
    assert (kernels / "xaccel_concurrent_probe.py").read_text() == f"VALUE = {sum(range(1000))}\n"
    assert not list(kernels.glob("*.tmp"))


def _compile_and_compare(fn, *inputs):
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch_xaccel.XaccelFallbackWarning)
        got = torch.compile(fn, backend="xaccel")(*inputs)
    torch.testing.assert_close(got, fn(*inputs), equal_nan=True)
    return torch_xaccel.last_report()


def test_nan_and_inf_inputs_propagate_as_eager():
    x, w = torch.randn(6, 4), torch.randn(5, 4)
    x[0, 0], x[1, 1], w[2, 3] = float("nan"), float("inf"), float("-inf")
    report = _compile_and_compare(lambda x, w: torch.sigmoid(x @ w.t()) + 1, x, w)
    assert report.counts()["gemm_epilogue"] == 1


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.float64])
def test_integer_complex_and_float64_gemms_stay_with_aten_and_say_why(dtype):
    x, w = torch.randn(6, 4).to(dtype), torch.randn(5, 4).to(dtype)
    report = _compile_and_compare(lambda x, w: (x @ w.t()) * 2, x, w)
    assert report.counts()["gemm_epilogue"] == 0
    assert any("dtype" in f.reason for f in report.fallbacks), str(report)


def test_meta_inputs_stay_with_aten_and_say_why():
    x, w = torch.empty(6, 4, device="meta"), torch.empty(5, 4, device="meta")
    torch._dynamo.reset()
    out = torch.compile(lambda x, w: torch.relu(x @ w.t()) * 2, backend="xaccel")(x, w)
    assert out.shape == (6, 5) and out.device.type == "meta"
    report = torch_xaccel.last_report()
    assert report.counts()["gemm_epilogue"] == 0 and any("device" in f.reason for f in report.fallbacks)


def test_empty_rows_and_later_dtype_and_shape_changes_match_eager():
    """M = 0, then other shapes and another dtype on later calls of one compiled function: each
    call equals eager (Dynamo recompiles where its guards say so)."""
    fn = lambda x, w: torch.nn.functional.gelu(x @ w.t()) - 0.5  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="xaccel")
    calls = ((0, torch.float32), (3, torch.float32), (7, torch.float32), (5, torch.float16), (2, torch.float64))
    g = torch.Generator().manual_seed(0)
    for m, dtype in calls:
        x, w = torch.randn(m, 4, generator=g).to(dtype), torch.randn(5, 4, generator=g).to(dtype)
        got = compiled(x, w)
        assert got.dtype == dtype and got.shape == (m, 5)
        # fp16: the fused chain rounds once where eager rounds per op, a last-place difference
        tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else {}
        torch.testing.assert_close(got, fn(x, w), **tol)
