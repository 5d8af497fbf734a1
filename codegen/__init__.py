"""Kernel generation. Installed as torch_xaccel.codegen.

Shared: render.py (a family's jinja2 templates and their digest), cache.py (the on-disk cache
under XACCEL_CACHE_DIR: rendered sources, CUTLASS builds, tuning decisions), tuning.py (the one
tuner: keys, XACCEL_TUNE, the interpreter, CUDA-graph capture, timing), limits.py (the int32
reach of kernel offsets, the shared memory a tile config may ask), triton_launch.py (relaunching a
compiled Triton kernel directly), precision.py (the input precision of fp32 dots: what torch's float32
matmul setting allows).

Per family (`codegen/<family>/`): its renderers, configs and templates/, and the kernel providers
families.py names. A provider returns NotImplemented for cases it does not cover, and the op's
reference runs instead (torch_xaccel/runtime.py).
"""
