"""torch_xaccel.explain: what the backend would do with a model on given inputs."""
from __future__ import annotations

import re

from . import runtime
from .report import Fallback, Report, collect


def explain(model, *args, **kwargs) -> Report:
    """Compile `model` with the xaccel backend on these inputs, run it once, and report:
    replacements per family, fallbacks with reasons, Dynamo graph breaks, kernel failures and, for
    each GEMM case the run used, which kernel the tuner chose (and CUTLASS builds still pending).

    Like torch._dynamo.explain, this resets Dynamo's caches before and after (models compiled
    earlier recompile on their next call)."""
    import torch._dynamo

    from .backend import xaccel_backend

    breaks = torch._dynamo.explain(model)(*args, **kwargs).break_reasons
    n_events = len(runtime.EVENTS)
    torch._dynamo.reset()
    runtime.SEEN = seen = set()
    try:
        with collect() as graphs:
            torch.compile(model, backend=xaccel_backend)(*args, **kwargs)
    finally:
        runtime.SEEN = None
        torch._dynamo.reset()
    report = Report(graphs=graphs, runtime_fallbacks=runtime.EVENTS[n_events:],
                    kernel_choices=[runtime.CHOICES[k] for k in seen if k in runtime.CHOICES])
    for b in breaks:
        frames = getattr(b, "user_stack", None) or []
        where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else ""
        report.graph_breaks.append(Fallback("graph_break", _break_reason(str(b.reason)), where))
    return report


def _break_reason(text: str) -> str:
    """The first line of Dynamo's reason, or the message of a graph_break(msg=...) call (where
    torch_xaccel leaves library code as written, the message says why)."""
    message = re.search(r"User-inserted graph break\. Message: (.+)", text)
    if message and message.group(1).strip() not in ("", "None"):
        return message.group(1).strip()
    return text.strip().splitlines()[0]
