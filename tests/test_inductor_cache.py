"""The Inductor rest's caches with xaccel graphs: a second process reuses the first one's compiled
graph (AOTAutograd's cache hits), and a change to the xaccel ops' definitions makes it miss."""
import os
import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch_xaccel
    from torch_xaccel import inductor_cache
    from torch._dynamo.utils import counters
    if sys.argv[1] == "other-ops":  # as if torch_xaccel/ops/*.py had changed
        inductor_cache.ops_digest = lambda: "0" * 64
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(128, 64))
    x = torch.randn(32, 64)
    with torch.no_grad():
        y = torch.compile(m, backend="xaccel")(x)
        assert ((y - m(x)).norm() / m(x).norm()).item() < 1e-5
    assert torch_xaccel.last_report().counts()["gemm_epilogue"] == 1
    aot = counters["aot_autograd"]
    print(aot["autograd_cache_hit"], aot["autograd_cache_miss"])
""")


def _run(tmp_path, arg: str) -> tuple[int, int]:
    env = dict(os.environ, XACCEL_FALLBACK="inductor", XACCEL_CACHE_DIR=str(tmp_path / "xc"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, arg], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    hit, miss = map(int, proc.stdout.split()[-2:])
    return hit, miss


def test_a_second_process_reuses_the_compiled_graph_until_the_ops_change(tmp_path):
    """make_fx's ShapeEnv on the lowered graph, new in every process, stays out of AOTAutograd's
    cache key, or a second process would always miss (torch_xaccel/inductor_cache.py)."""
    assert _run(tmp_path, "first") == (0, 1)
    assert _run(tmp_path, "second") == (1, 0)
    assert _run(tmp_path, "other-ops") == (0, 1)


def test_prepare_drops_per_process_state_and_keys_by_the_ops():
    from torch._inductor import config as inductor_config

    from torch_xaccel import inductor_cache

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    gm.shape_env = object()
    gm.meta["xaccel_example_inputs"] = [torch.randn(2)]
    patches = inductor_cache.prepare(gm, {"max_autotune": True})
    assert "shape_env" not in gm.__dict__ and "xaccel_example_inputs" not in gm.meta
    key_pass = patches["post_grad_custom_pre_pass"]
    assert patches["max_autotune"] is True and key_pass.uuid().endswith(inductor_cache.ops_digest())
    assert len(inductor_cache.ops_digest()) == 64
    # a pass the user set (in the options or the config) is left alone
    mine = object()
    assert inductor_cache.prepare(gm, {"post_grad_custom_pre_pass": mine})["post_grad_custom_pre_pass"] is mine
    old = inductor_config.post_grad_custom_pre_pass
    inductor_config.post_grad_custom_pre_pass = key_pass
    try:
        assert inductor_cache.prepare(gm, {}) == {}
    finally:
        inductor_config.post_grad_custom_pre_pass = old
