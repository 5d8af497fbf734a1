"""The sLSTM CUDA kernels build on a machine without a GPU (NVRTC through cuda.core): every backward
configuration at the issue's main head size, the default forward and backward of each head size
the kernels take, every dtype (bf16 exchanges bf16 shares of dh in the backward, fp16 and fp32
fp32 ones; fp32 runs 3xTF32 products) and every variant switch, with no register spills in the
default kernels at D192; the global exchange (head dim 768, GPUs without clusters) for sm_90a and
sm_80; which exchange a case gets."""
import re
import shutil
import subprocess

import pytest
import torch

from torch_xaccel.codegen.slstm import configs, cuda_kernels

cc = pytest.importorskip("cuda.core")


def _build(kernel, D, cfg, dtype, variant=("batch", True, False), save=False, arch="sm_90a"):
    name, source = cuda_kernels.render(kernel, D, 4, cfg, dtype, *variant, save)
    try:
        cubin = cuda_kernels.compile_cubin(name, source, arch)
    except Exception as e:  # an NVRTC missing from this machine is a skip, a compile error a failure
        if "nvrtc" in str(e).lower() and "could not" in str(e).lower():
            pytest.skip(f"no NVRTC here: {e}")
        raise
    assert len(cubin) > 1000
    return source


@pytest.mark.parametrize("cfg", configs.backward_candidates(192), ids=lambda c: f"C{c['C']}-NW{c['NW']}")
def test_every_backward_configuration_at_d192_builds(cfg):
    _build("backward", 192, cfg, torch.bfloat16)


@pytest.mark.parametrize("D", [64, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_default_kernels_build_for_every_head_size(D, dtype):
    variant = ("element", False, True) if dtype == torch.float16 else ("batch", True, False)
    size = dtype.itemsize
    forward = _build("forward", D, configs.default(D, itemsize=size), dtype, variant, save=True)
    source = _build("backward", D, configs.backward_default(D, itemsize=size), dtype, variant)
    assert ("#define SB 2" in source) == (dtype == torch.bfloat16)  # the share width the template says
    assert ("mma_3xtf32" in forward and "mma_3xtf32" in source) == (dtype == torch.float32)


def test_head_dim_768_takes_the_global_exchange():
    assert configs.default(768) is None and configs.backward_default(768) is None  # R exceeds one cluster
    for max_group in (132, 33):  # one batch tile, four
        fwd, bwd = configs.default(768, "global", max_group), configs.backward_default(768, "global", max_group)
        assert fwd["C"] <= max_group and bwd["C"] <= max_group and fwd["U"] * fwd["C"] == 768
    # fp32's R takes twice the registers: a head of 768 needs 48 SMs or more (two batch tiles on 132)
    assert configs.default(768, "global", 66, 4)["C"] == 48 and configs.default(768, "global", 44, 4) is None


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("D,max_group", [(768, 132), (768, 33), (192, 33)])
def test_global_exchange_kernels_build(D, max_group, arch):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        variant = ("element", False, True) if dtype == torch.float16 else ("batch", True, False)
        fwd = configs.default(D, "global", max_group, dtype.itemsize)
        bwd = configs.backward_default(D, "global", max_group, dtype.itemsize)
        if dtype == torch.float32 and max_group < 48 and D == 768:
            assert fwd is None  # (the test above)
            continue
        _build("forward", D, fwd, dtype, variant, save=True, arch=arch)
        source = _build("backward", D, bwd, dtype, variant, arch=arch)
        assert "__cluster_dims__" not in source and "receive_flagged" in source


def _plan(monkeypatch, capability, sms, B, NH, D, dtype=torch.bfloat16):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(cuda_kernels, "_sm_count", lambda device: sms)
    return cuda_kernels.plan(torch.empty(B, 8, 4, NH, D, device="meta", dtype=dtype))


def test_which_exchange_a_case_gets(monkeypatch):
    assert _plan(monkeypatch, (9, 0), 132, 16, 4, 192) == ("cluster", None)
    assert _plan(monkeypatch, (9, 0), 132, 16, 1, 768) == ("global", 132)
    assert _plan(monkeypatch, (9, 0), 132, 64, 1, 768) == ("global", 33)  # four batch tiles share the SMs
    assert _plan(monkeypatch, (8, 0), 108, 16, 4, 192) == ("global", 27)  # no clusters before sm_90
    why = _plan(monkeypatch, (9, 0), 132, 64, 12, 768)  # 48 groups: too few SMs for one group each
    assert isinstance(why, str) and "768" in why and "132 SMs" in why
    assert _plan(monkeypatch, (9, 0), 132, 16, 4, 192, torch.float32) == ("cluster", None)
    assert _plan(monkeypatch, (9, 0), 132, 32, 1, 768, torch.float32) == ("global", 66)
    assert isinstance(_plan(monkeypatch, (9, 0), 132, 64, 1, 768, torch.float32), str)  # fp32 R: 48 SMs a tile


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc for ptxas statistics")
@pytest.mark.parametrize("kernel,dtype", [("backward", torch.bfloat16), ("forward", torch.float32),
                                          ("backward", torch.float32)], ids=str)
def test_default_kernels_at_d192_do_not_spill(tmp_path, kernel, dtype):
    """(fp32: R's 3xTF32 halves are split at each use; hoisted out of the time loop they would hold
    twice R's registers and spill)"""
    size = dtype.itemsize
    cfg = configs.default(192, itemsize=size) if kernel == "forward" else configs.backward_default(192, itemsize=size)
    source = _build(kernel, 192, cfg, dtype, save=kernel == "forward")
    path = tmp_path / "bwd.cu"
    path.write_text(source)
    out = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "bwd.cubin"), "-Xptxas", "-v",
                          "-I", str(cuda_kernels.INCLUDE), str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out.stderr)]
    assert spills and max(spills) == 0, out.stderr[-2000:]
