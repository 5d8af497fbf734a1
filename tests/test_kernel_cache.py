"""The on-disk cache: corrupt or foreign entries are ignored, writers never leave half files,
and concurrent processes tuning one key wait for each other."""
import json
import multiprocessing
import os
import time

import pytest

from torch_xaccel.codegen import cache


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XACCEL_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_round_trip():
    cache.write_entry("tuning", "k1", {"config": [1, 2]})
    assert cache.read_entry("tuning", "k1") == {"config": [1, 2]}
    assert cache.read_entry("tuning", "missing") is None


def test_corrupt_entry_is_ignored(tmp_path):
    cache.write_entry("tuning", "k1", {"config": [1]})
    path = tmp_path / "tuning" / f"{cache.key_name('k1')}.json"
    path.write_text('{"key": "k1", "val')  # torn write
    assert cache.read_entry("tuning", "k1") is None
    path.write_text("[1, 2, 3]")
    assert cache.read_entry("tuning", "k1") is None


def test_foreign_entry_is_ignored(tmp_path):
    path = tmp_path / "tuning" / f"{cache.key_name('k1')}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": "another key with a colliding file name", "value": {"config": [9]}}))
    assert cache.read_entry("tuning", "k1") is None


def _tune_once(root, log):
    os.environ["XACCEL_CACHE_DIR"] = root
    with cache.locked("shared-key"):
        if cache.read_entry("tuning", "shared-key") is None:
            with open(log, "a") as fh:
                fh.write("tuned\n")
            time.sleep(0.3)  # a slow tuning run: the other process must wait, then reuse it
            cache.write_entry("tuning", "shared-key", {"config": [os.getpid()]})
    return cache.read_entry("tuning", "shared-key")


def test_concurrent_processes_tune_once(tmp_path):
    log = tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        results = pool.starmap(_tune_once, [(str(tmp_path), str(log))] * 3)
    assert log.read_text().count("tuned") == 1
    assert all(r == results[0] for r in results)
    assert not list((tmp_path / "tuning").glob("*.tmp"))
