"""The op families: the one list of what the backend can find and replace.

A family is one package under the same name in every layer: `torch_xaccel/ops/<family>/` (its
torch.ops.xaccel.* ops and their one reference), `lowering/<family>/` (its graph passes),
`codegen/<family>/` (its kernels and templates) and `tests/<family>/`. Everything shared (the
backend, the runtime, the tuner, the cache, the report, the config) learns about families only
from this table, by module path: none of it imports a family. Adding a family is its folders plus
one entry here (docs/architecture.md walks through one).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FamilySetting:
    """One of a family's own settings, plain data: config.py adds it to its table (SETTINGS) and to
    Config beside the shared ones, so it is set as they are (XACCEL_<NAME>, the option
    `xaccel.<name>`, config.patch(<name>=...)) and read as `cfg.<name>`."""
    name: str
    default: Any
    help: str
    # how a raw value parses: "flag" (0/1, true/false, yes/no, on/off), "optional_flag" (a flag, or
    # None: unset) or "choice" (one of `choices`; where they hold "0" and "1", a flag's spellings too)
    kind: str = "flag"
    choices: tuple[str, ...] = ()
    # read when a kernel is built or tuned (at any call), not only when a graph compiles
    # (config.KERNEL_SETTINGS): a compile's option for it applies at its graph's calls
    at_call: bool = False


@dataclass(frozen=True)
class Family:
    name: str
    # pattern name -> its pass, "module:function" run(gm, ctx); the names are what XACCEL_PATTERNS
    # accepts and what the report counts, and PASS_ORDER says when each runs
    passes: dict[str, str] = field(default_factory=dict)
    # report keys beyond the pass names (a family declared before its passes exist)
    reports: tuple[str, ...] = ()
    ops: str | None = None  # the module that registers the family's torch.ops.xaccel.* ops
    # op name -> its kernel provider "module:function" provider(key, *args) -> outputs | NotImplemented,
    # imported at the first call that can run a kernel (a CUDA tensor, or Triton's interpreter)
    providers: dict[str, str] = field(default_factory=dict)
    # "module:function" run(gm, ctx) each, in order, after every pass, when any of the family's
    # patterns is enabled
    after_passes: tuple[str, ...] = ()
    # "module:function" backward_pass(cfg) -> run(gm, report) | None: a pass over aot_autograd's
    # backward graphs, run at the first backward call
    backward_pass: str | None = None
    # pattern name -> "module:function" run(gm, report, graph_name): a pass over every graph the
    # rest of a compile runs eagerly (an inference graph, aot_autograd's forward and backward),
    # after the other passes; its name is a pattern as the passes' are
    rest_passes: dict[str, str] = field(default_factory=dict)
    # "module:function" register(): hooks that must exist before Dynamo traces (library functions
    # traced as xaccel ops); called when the backend loads and at every compile
    trace_hooks: str | None = None
    # op name -> "module:function" body(call) -> onnx.FunctionProto: the op's ONNX body, built from
    # its reference (torch_xaccel.onnx attaches it); an op without one is not fused in an export
    onnx: dict[str, str] = field(default_factory=dict)
    # pattern -> the xaccel ops its pass inserts, where they are not just the pattern's name
    emits: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # ops that run one decode step: bound by host time when called outside a CUDA graph (the
    # report hints at one)
    decode_ops: tuple[str, ...] = ()
    # op name -> its argument that adds to its output before rounding: Tensor? for an op of one
    # output, Tensor?[] (entry j for output j) for a list; gradient_sums folds gradient sums into it
    addends: dict[str, str] = field(default_factory=dict)
    # "module:function" cases(quick: bool) -> list[Case]: the family's bench suite
    # (`python -m torch_xaccel.bench <family>`), in torch_xaccel/bench/<family>.py
    bench: str | None = None
    # the settings only this family reads (FamilySetting); each name is unique among every family's
    # and the shared ones (config.py raises at import otherwise)
    settings: tuple[FamilySetting, ...] = ()

    @property
    def patterns(self) -> tuple[str, ...]:
        return tuple(self.passes) + tuple(self.rest_passes)

    @property
    def report_keys(self) -> tuple[str, ...]:
        return self.patterns + self.reports


FAMILIES: tuple[Family, ...] = (
    Family(
        "gemm_epilogue",
        passes={"gemm_epilogue": "torch_xaccel.lowering.gemm_epilogue.chains:run"},
        ops="torch_xaccel.ops.gemm_epilogue",
        providers={"gemm_epilogue": "torch_xaccel.codegen.gemm_epilogue:provider"},
        backward_pass="torch_xaccel.lowering.gemm_epilogue.backward:backward_pass",
        onnx={"gemm_epilogue": "torch_xaccel.ops.gemm_epilogue.onnx:gemm_epilogue_function"},
        bench="torch_xaccel.bench.gemm_epilogue:cases",
        settings=(
            FamilySetting("cutlass", "1", kind="choice", choices=("0", "1", "wait"), at_call=True,
                          help="\"1\" CUTLASS GEMM kernels build in the background and join tuning once built; "
                               "\"wait\" tuning builds them first; \"0\" never (default 1)"),
            FamilySetting("backward_fusion", None, kind="optional_flag",
                          help="fuse the GEMM chains of training graphs' backward too "
                               "(default unset: on where CUTLASS kernels run)"),
            FamilySetting("leave_to_inductor", True,
                          help="with the Inductor rest, a GEMM chain that only feeds reductions Inductor "
                               "fuses it into stays with Inductor and cuBLAS (default on)"),
        ),
    ),
    Family(
        "mlstm",
        passes={"mlstm": "torch_xaccel.lowering.mlstm.parallel:run",
                "mlstm_step": "torch_xaccel.lowering.mlstm.step:run"},
        ops="torch_xaccel.ops.mlstm",
        emits={"mlstm_step": ("mlstm_step", "mlstm")},  # a loop of steps over a prefill becomes xaccel.mlstm
        decode_ops=("mlstm_step",),
        providers={"mlstm": "torch_xaccel.codegen.mlstm:forward",
                   "mlstm_saving": "torch_xaccel.codegen.mlstm:forward_saving",
                   "mlstm_backward": "torch_xaccel.codegen.mlstm:backward",
                   "mlstm_step": "torch_xaccel.codegen.mlstm:step"},
        after_passes=("torch_xaccel.lowering.mlstm.h_layout:run", "torch_xaccel.lowering.mlstm.saving:run"),
        trace_hooks="torch_xaccel.lowering.mlstm.substitutions:register",
        onnx={"mlstm": "torch_xaccel.ops.mlstm.onnx:mlstm_function",
              "mlstm_step": "torch_xaccel.ops.mlstm.onnx:mlstm_step_function"},
        bench="torch_xaccel.bench.mlstm:cases",
        settings=(
            FamilySetting("mlstm_saving", True,
                          help="a training graph's mLSTM saves the state entering each chunk for its "
                               "backward (xaccel::mlstm_saving; default on)"),
        ),
    ),
    Family(
        "headwise",
        passes={"headwise": "torch_xaccel.lowering.headwise.einsum:run"},
        ops="torch_xaccel.ops.headwise",
        providers={"headwise": "torch_xaccel.codegen.headwise:forward",
                   "headwise_weight_grad": "torch_xaccel.codegen.headwise:weight_grad"},
        onnx={"headwise": "torch_xaccel.ops.headwise.onnx:headwise_function"},
        addends={"headwise": "addend"},  # (the input gradient is the op itself)
        bench="torch_xaccel.bench.headwise:cases",
    ),
    Family(
        "causal_conv",
        passes={"causal_conv": "torch_xaccel.lowering.causal_conv.conv1d:run"},
        ops="torch_xaccel.ops.causal_conv",
        providers={"causal_conv1d": "torch_xaccel.codegen.causal_conv:forward",
                   "causal_conv1d_backward": "torch_xaccel.codegen.causal_conv:backward"},
        onnx={"causal_conv1d": "torch_xaccel.ops.causal_conv.onnx:causal_conv1d_function"},
        emits={"causal_conv": ("causal_conv1d",)},
        bench="torch_xaccel.bench.causal_conv:cases",
    ),
    Family(
        "group_norm",
        passes={"group_norm": "torch_xaccel.lowering.group_norm.rows:run"},
        ops="torch_xaccel.ops.group_norm",
        providers={"group_norm": "torch_xaccel.codegen.group_norm:forward",
                   "group_norm_backward": "torch_xaccel.codegen.group_norm:backward"},
        onnx={"group_norm": "torch_xaccel.ops.group_norm.onnx:group_norm_function"},
        bench="torch_xaccel.bench.group_norm:cases",
    ),
    Family(
        "skinny_linear",
        passes={"skinny_linear": "torch_xaccel.lowering.skinny_linear.shared_input:run"},
        ops="torch_xaccel.ops.skinny_linear",
        providers={"skinny_linear": "torch_xaccel.codegen.skinny_linear:forward",
                   "skinny_linear_backward": "torch_xaccel.codegen.skinny_linear:backward"},
        onnx={"skinny_linear": "torch_xaccel.ops.skinny_linear.onnx:skinny_linear_function"},
        addends={"skinny_linear_backward": "addends"},
        bench="torch_xaccel.bench.skinny_linear:cases",
    ),
    Family(
        "slstm",
        passes={"slstm": "torch_xaccel.lowering.slstm.sequence:run",
                "slstm_step": "torch_xaccel.lowering.slstm.step:run"},
        ops="torch_xaccel.ops.slstm",
        providers={"slstm": "torch_xaccel.codegen.slstm:forward",
                   "slstm_saving": "torch_xaccel.codegen.slstm:forward_saving",
                   "slstm_backward": "torch_xaccel.codegen.slstm:backward",
                   "slstm_step": "torch_xaccel.codegen.slstm:step"},
        after_passes=("torch_xaccel.lowering.slstm.saving:run",),
        trace_hooks="torch_xaccel.lowering.slstm.substitutions:register",
        decode_ops=("slstm_step",),
        onnx={"slstm": "torch_xaccel.ops.slstm.onnx:slstm_function",
              "slstm_step": "torch_xaccel.ops.slstm.onnx:slstm_step_function"},
        bench="torch_xaccel.bench.slstm:cases",
    ),
    Family(
        "pointwise",
        rest_passes={"pointwise": "torch_xaccel.lowering.pointwise.groups:run"},
        ops="torch_xaccel.ops.pointwise",
        providers={"pointwise": "torch_xaccel.codegen.pointwise:forward"},
    ),
)

# When each pattern's pass runs. Larger patterns first: the mLSTM and sLSTM regions hold matmuls
# (and per-head einsums) the GEMM and headwise passes would otherwise take, and each family's step
# pass runs before its sequence form so that the steps it replaces are not reported as
# unrecognized sequences.
PASS_ORDER: tuple[str, ...] = ("slstm_step", "slstm", "mlstm_step", "mlstm", "headwise", "causal_conv",
                               "group_norm", "skinny_linear", "gemm_epilogue")

PATTERNS: tuple[str, ...] = tuple(p for f in FAMILIES for p in f.patterns)  # what XACCEL_PATTERNS accepts
REPORT_KEYS: tuple[str, ...] = tuple(k for f in FAMILIES for k in f.report_keys)  # counts() keys, in order
DECODE_OPS: frozenset[str] = frozenset(f"xaccel.{op}" for f in FAMILIES for op in f.decode_ops)  # as reports name them

assert sorted(PASS_ORDER) == sorted(p for f in FAMILIES for p in f.passes), \
    "PASS_ORDER must list every family's graph passes once"


def family_of(pattern: str) -> Family:
    return next(f for f in FAMILIES if pattern in f.patterns)


def ordered_passes() -> list[tuple[str, str]]:
    """(pattern, pass path) in PASS_ORDER."""
    return [(p, family_of(p).passes[p]) for p in PASS_ORDER]


def rest_passes(patterns) -> list[tuple[str, str]]:
    """(pattern, pass path) of the rest passes among `patterns`, in the families' order."""
    return [(p, path) for f in FAMILIES for p, path in f.rest_passes.items() if p in patterns]


def provider_paths(op: str) -> list[str]:
    return [path for f in FAMILIES for name, path in f.providers.items() if name == op]


def resolve(path: str):
    """The object a "module:attribute" path names, looked up now (the module imported on first use)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def addend_args() -> dict:
    """OpOverload -> the name of its addend argument (Family.addends), the ops registered."""
    import torch

    import_ops()
    return {getattr(torch.ops.xaccel, op).default: arg for f in FAMILIES for op, arg in f.addends.items()}


def import_ops() -> None:
    """Register every family's torch.ops.xaccel.* ops."""
    for f in FAMILIES:
        if f.ops:
            importlib.import_module(f.ops)


def install_trace_hooks() -> None:
    for f in FAMILIES:
        if f.trace_hooks:
            resolve(f.trace_hooks)()
