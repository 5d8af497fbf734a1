"""The sLSTM CUDA kernels build on a machine without a GPU (NVRTC through cuda.core): every backward
configuration at the issue's main head size, the default forward and backward of each head size
the kernels take, both 16-bit dtypes (bf16 exchanges bf16 shares of dh in the backward, fp16
fp32 ones) and every variant switch, with no register spills in the default backward."""
import re
import shutil
import subprocess

import pytest
import torch

from torch_xaccel.codegen.slstm import configs, cuda_kernels

cc = pytest.importorskip("cuda.core")


def _build(kernel, D, cfg, dtype, variant=("batch", True, False), save=False):
    name, source = cuda_kernels.render(kernel, D, 4, cfg, dtype, *variant, save)
    try:
        cubin = cuda_kernels.compile_cubin(name, source, "sm_90a")
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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_default_kernels_build_for_every_head_size(D, dtype):
    variant = ("element", False, True) if dtype == torch.float16 else ("batch", True, False)
    _build("forward", D, configs.default(D), dtype, variant, save=True)
    source = _build("backward", D, configs.backward_default(D), dtype, variant)
    assert ("#define SB 2" in source) == (dtype == torch.bfloat16)  # the share width the template says


def test_no_kernel_for_head_dim_768():
    assert configs.backward_default(768) is None  # R [4D, U] per CTA exceeds the registers of one cluster


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc for ptxas statistics")
def test_default_backward_at_d192_does_not_spill(tmp_path):
    source = _build("backward", 192, configs.backward_default(192), torch.bfloat16)
    path = tmp_path / "bwd.cu"
    path.write_text(source)
    out = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "bwd.cubin"), "-Xptxas", "-v",
                          "-I", str(cuda_kernels.INCLUDE), str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out.stderr)]
    assert spills and max(spills) == 0, out.stderr[-2000:]
