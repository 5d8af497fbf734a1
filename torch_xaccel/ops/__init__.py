"""The torch.ops.xaccel.* custom ops: the contract between lowering, runtime and ONNX export.

Each family's package here (`ops/<family>/`) registers its ops: the schema, the one reference
(the op's only semantics, its CPU path and the kernels' test oracle), the fake (shape) function
and the autograd formula. Kernels are not imported here: the runtime finds them (families.py).
"""
from __future__ import annotations

import importlib

from .. import families

families.import_ops()

# op overload -> the plain function behind it. A compiled forward or backward graph runs with
# autograd already handled by aot_autograd, so it may call these directly and skip the custom-op
# dispatch (host time that decides whether decode-size calls and training steps pay off). Each
# family's ops module lists its own.
DIRECT_CALLS: dict = {}
for _family in families.FAMILIES:
    if _family.ops:
        DIRECT_CALLS.update(getattr(importlib.import_module(_family.ops), "DIRECT_CALLS", {}))
