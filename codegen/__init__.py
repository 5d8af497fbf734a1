"""Kernel source generation: jinja2 templates rendered from an op's parameters (the epilogue IR for
GEMMs), built and cached on disk under XACCEL_CACHE_DIR. Installed as torch_xaccel.codegen.

Empty until the generated Triton GEMM kernels land (issue 3); until then every xaccel op runs its
reference ATen composition through torch_xaccel.runtime.
"""
