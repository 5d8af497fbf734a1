"""Kernel source generation: jinja2 templates (templates/) rendered per op and specialisation, built
by Triton, cached on disk under XACCEL_CACHE_DIR (cache.py). Installed as torch_xaccel.codegen.

- render.py + triton_gemm.py: GEMM + epilogue kernels for xaccel::gemm_epilogue, with tuning.
- triton_mlstm.py: chunkwise mLSTM forward and backward, and the decode step kernel.
- offsets.py: how far the kernels' int32 offsets reach (both decline larger tensors).
Each module is a runtime provider: it returns NotImplemented for cases it does not cover, and the
op's reference runs instead (torch_xaccel/runtime.py).
"""
