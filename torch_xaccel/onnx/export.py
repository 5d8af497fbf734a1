"""torch_xaccel.onnx.export: the compile's lowering, written as ONNX.

torch.export -> the same pattern passes as torch.compile(backend="xaccel") on the exported ATen
graph (so the same matches, refusals and report) -> each xaccel op as one `xaccel`-domain node
(symbolic.py) -> torch.onnx's exporter -> a FunctionProto per node form (functions.py), so that a
stock onnxruntime runs the model with no plugin. Families whose ops have no ONNX body yet are left
out of the passes, and so is a family whose pass fixes a dim the caller declared dynamic: their
code exports as standard ONNX, and the report says so. The result keeps torch.onnx's IR model,
whose weights are the model's own tensors (never copied), and writes it with its weights in a
`.data` file beside it where one file would pass protobuf's 2 GB limit (ExportResult.save)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import types
from dataclasses import dataclass, field

import torch

from torch_xaccel import config, families
from torch_xaccel.report import Fallback, Report, new_graph_report

from . import functions as bodies, symbolic

# protobuf serializes no message of 2 GiB or more: a model whose file would reach it keeps its
# weights in a file beside it (ONNX external data). Tests lower it to exercise that path.
EXTERNAL_DATA_THRESHOLD = 2**31 - 1

logger = logging.getLogger("torch_xaccel.onnx")


@dataclass
class ExportResult:
    program: object = field(repr=False, compare=False)  # torch.onnx.ONNXProgram: the model as onnx IR, bodies attached
    path: str | None  # where it was last written (export's `f` or save()), None if never
    report: Report  # what became xaccel nodes, what stayed standard ONNX and why
    xaccel_nodes: dict[str, int] = field(default_factory=dict)  # op -> its nodes in the graph
    data_path: str | None = None  # the external data file beside `path`, None if the weights are inside it
    _proto: object = field(default=None, repr=False, compare=False)

    @property
    def model(self):
        """The onnx.ModelProto (serialized from `program` on first access, every weight copied
        into it: for a model near or over 2 GB use save() instead)."""
        if self._proto is None:
            self._proto = self.program.model_proto
        return self._proto

    def save(self, path, external_data: bool | None = None) -> None:
        """Write the model to `path`. external_data: None (default) puts the weights in
        `<file name>.data` beside it when one file would pass protobuf's 2 GB limit, and in the
        file otherwise; True always does, False never does (a model over the limit: ValueError).
        onnxruntime.InferenceSession(path) and onnx.load(path) find the data file by the name the
        model records. The weights written are the model's own tensors as they are now."""
        from onnxscript import ir

        path = os.fspath(path)
        model = self.program.model
        size = serialized_size(model)
        over = size > EXTERNAL_DATA_THRESHOLD
        if external_data is False and over:
            raise ValueError(f"torch_xaccel.onnx: the model is over protobuf's 2 GB limit "
                             f"({size / 2**30:.2f} GiB): save it with external_data=True (or None)")
        data = os.path.basename(path) + ".data" if external_data or (external_data is None and over) else None
        ir.save(model, path, external_data=data)
        self.path, self.data_path = path, os.path.join(os.path.dirname(path), data) if data else None

    def nodes(self) -> str:
        """The xaccel node counts as one line: "gemm_epilogue=12, slstm=2" ("none")."""
        return ", ".join(f"{k}={v}" for k, v in sorted(self.xaccel_nodes.items())) or "none"

    def __str__(self) -> str:
        where = f" to {self.path}" if self.path else ""
        if self.data_path:
            where += f" (weights in {os.path.basename(self.data_path)})"
        return f"ONNX export{where}: xaccel nodes {self.nodes()}\n{self.report}"


@contextlib.contextmanager
def _weights_left_out(model):
    """`model` (onnx IR) with each initializer's data replaced by an external reference to
    nowhere (its name, dtype and dims kept), so that serializing it copies no weight."""
    from onnxscript import ir

    kept = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None or isinstance(tensor, ir.ExternalTensor):
            continue
        kept[value] = tensor
        value.const_value = ir.ExternalTensor("(left out)", 0, tensor.nbytes, tensor.dtype, shape=tensor.shape,
                                              name=tensor.name or value.name)
    try:
        yield model
    finally:
        for value, tensor in kept.items():
            value.const_value = tensor


def without_weights(model):
    """The onnx.ModelProto of `model` (onnx IR) without its initializers' data."""
    from onnxscript import ir

    with _weights_left_out(model):
        return ir.serde.serialize_model(model)


def serialized_size(model) -> int:
    """The bytes of `model` (onnx IR) as one protobuf file, about (its weights' bytes and the rest)."""
    weights = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    return weights + without_weights(model).ByteSize()


def _copy_functions(proto, model) -> None:
    """The bodies attach() added to `proto` (without_weights(model)) into `model`: each xaccel
    node's overload, each function."""
    from onnxscript import ir

    for node, ir_node in zip(proto.graph.node, model.graph, strict=True):
        if node.overload:
            ir_node.overload = node.overload
    for fn in proto.functions:
        function = ir.serde.deserialize_function(fn)
        model.functions[function.identifier()] = function


def _exportable_patterns(cfg) -> tuple[set[str], list[str]]:
    """(the patterns whose every op has an ONNX body, the others). Graph passes only: the rest
    passes rewrite what a compile runs eagerly, which an export does not run."""
    translated = bodies.translatable()
    ok, missing = set(), []
    for f in families.FAMILIES:
        for pattern in f.passes:
            if pattern not in cfg.patterns:
                continue
            if all(op in translated for op in f.emits.get(pattern, (pattern,))):
                ok.add(pattern)
            else:
                missing.append(pattern)
    return ok, missing


def _resync_outputs(ep) -> None:
    """The passes may replace a node that the graph returns: point the exported program's output
    specs at the output node's arguments again (names are what its signature records)."""
    out = next(n for n in ep.graph_module.graph.nodes if n.op == "output")
    returned = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    for spec, node in zip(ep.graph_signature.output_specs, returned):
        if isinstance(node, torch.fx.Node) and hasattr(spec.arg, "name"):
            spec.arg = dataclasses.replace(spec.arg, name=node.name)


def _exported(model, args, kwargs, dynamic_shapes, strict, report):
    """torch.export's program. strict=None: Dynamo first (it applies the library substitutions, so
    the export finds what a compile finds), non-strict where Dynamo cannot trace the model."""
    def run(strict_mode: bool):
        if strict_mode:
            families.install_trace_hooks()
        try:
            with bodies.quiet_exporter():
                return torch.export.export(model, args, kwargs=kwargs, dynamic_shapes=dynamic_shapes,
                                           strict=strict_mode)
        except Exception as e:
            unkeepable = _constraint_error(e)
            if unkeepable is None:
                raise
            raise unkeepable from e
    if strict is not None:
        return run(strict)
    try:
        return run(True)
    except _UnkeepableDim:  # the model's own code: tracing without Dynamo would meet it again
        raise
    except Exception as e:  # noqa: BLE001 - retried without Dynamo; that failure is the one raised
        first = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    ep = run(False)
    report.fallbacks.append(Fallback("backend", f"exported without Dynamo (torch.export non-strict; the library "
                                                f"substitutions do not apply): Dynamo failed ({first})"))
    return ep


class _UnkeepableDim(ValueError):
    """A dynamic dim the model's own code specializes (torch.export's "Constraints violated")."""


def _constraint_error(e: Exception) -> ValueError | None:
    """torch.export's "Constraints violated" (a dim the caller marked dynamic that the model's own
    code branches on, e.g. padding a sequence to a multiple of its chunk size) as an error that
    says so and what to declare instead; None for any other failure."""
    text = str(e)
    if "Constraints violated" not in text:
        return None
    dims = re.search(r"Constraints violated \(([^)]*)\)", text)
    name = dims.group(1) if dims else "a dim"
    if "specialized it to be a constant" in text:  # no symbolic form can hold: e.g. a Python loop over the dim
        return _UnkeepableDim(
            f"torch_xaccel.onnx.export: torch.export cannot keep {name} symbolic: the model's own code fixes it to "
            "the example's size (a Python loop over it, which the trace unrolls, does that): leave it static. "
            "torch.export said:\n" + text[:3000])
    guards = [line.strip(" -") for line in text.splitlines() if "satisfy the generated guard" in line][:2]
    return _UnkeepableDim(
        f"torch_xaccel.onnx.export: torch.export cannot keep {name} symbolic: the "
        f"model's own code branches on it ({'; '.join(guards) or 'see below'}). Declare the dim in the form that "
        "code needs (for code that pads a sequence to a multiple of its chunk size: "
        "`chunk * torch.export.Dim('s')`) or leave it static. torch.export said:\n" + text[:3000])


def _check_translatable(ep) -> None:
    """An xaccel op in the graph (the model's own call, or a pass) with no ONNX body: a clear error
    now, not an exporter failure or a file that fails later."""
    from torch_xaccel.lowering.graph_utils import location

    known = bodies.translatable()
    for node in ep.graph_module.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "xaccel":
            name = target._schema.name.split("::")[1]
            if name not in known:
                raise ValueError(f"torch_xaccel.onnx.export: xaccel::{name} ({location(node) or 'in the model'}) "
                                 f"has no ONNX body yet; the ops with one: {', '.join(sorted(known))}")


def _lower(ep, cfg, report) -> None:
    from torch_xaccel.lowering import PassContext, run_passes

    run_passes(ep.graph_module, PassContext(cfg, report, training=False))
    _resync_outputs(ep)


@dataclass(frozen=True)
class _FixedDim:
    """A dim the caller declared dynamic that a pass fixed to a number (a guard on its size, such
    as int() of it): every value and body downstream would then hold that number."""
    input: str
    axis: int
    value: int
    where: str  # the line whose guard fixed it ("lowering/mlstm/provenance.py:234"), "" if unknown
    family: str | None  # the family of that line's pass, None if not a family's

    def reason(self) -> str:
        by = f"the {self.family} pass" if self.family else "a pass"
        left_out = f"the {self.family} patterns" if self.family else "the passes"
        return (f"dim {self.axis} of input {self.input}, declared dynamic, would be fixed to {self.value} by {by}"
                f"{' (' + self.where + ')' if self.where else ''}: exported without {left_out} (that code as "
                "standard ONNX), so the file keeps the dim symbolic")


def _input_symbols(ep) -> dict:
    """symbol -> (input name, axis, ShapeEnv) of the symbols in the program's user inputs' dims
    (a derived dim such as `16 * Dim("s")` holds one)."""
    user = set(ep.graph_signature.user_inputs)
    found: dict = {}
    for node in ep.graph_module.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or node.name not in user or not isinstance(val, torch.Tensor):
            continue
        for axis, size in enumerate(val.shape):
            for symbol in size.node.expr.free_symbols if isinstance(size, torch.SymInt) else ():
                found.setdefault(symbol, (node.name, axis, size.node.shape_env))
    return found


def _guard_site(env, symbol) -> tuple[str, str | None]:
    """(the line that fixed `symbol`, its family) from the ShapeEnv's record of the replacement."""
    import torch_xaccel.lowering as lowering

    frame = getattr(getattr(env, "replacements_slocs", {}).get(symbol), "framework_loc", None)
    if not hasattr(frame, "filename"):
        return "", None
    rel = os.path.relpath(os.path.abspath(frame.filename), os.path.dirname(os.path.abspath(lowering.__file__)))
    if rel.startswith(".."):
        return f"{os.path.basename(frame.filename)}:{frame.lineno}", None
    folder = rel.split(os.sep)[0]
    return f"lowering/{rel}:{frame.lineno}", folder if folder in {f.name for f in families.FAMILIES} else None


def _fixed_dims(symbols: dict) -> list[_FixedDim]:
    """The dims of `symbols` (_input_symbols before the passes) that are numbers now."""
    fixed = []
    for symbol, (name, axis, env) in symbols.items():
        value = env.replace(symbol)
        if value.is_number:
            fixed.append(_FixedDim(name, axis, int(value), *_guard_site(env, symbol)))
    return fixed


def _without_families_of(cfg, fixed: list[_FixedDim]):
    """cfg without the patterns of the families whose passes fixed a dim (all of them where one
    is unknown, or where that would leave the patterns as they are)."""
    names = {d.family for d in fixed}
    drop = {p for f in families.FAMILIES if f.name in names for p in f.patterns}
    kept = cfg.patterns - drop if None not in names else frozenset()
    return dataclasses.replace(cfg, patterns=frozenset(kept if kept != cfg.patterns else ()))


def _lowered(ep, cfg, report, trace):
    """The program after the passes; `trace()` traces the model anew. A pass that raises: the
    model exported as written, as a compile would run it. A pass that fixes a dim the caller
    declared dynamic: the model traced and lowered again without that pass's family, so the file
    keeps the dim; the report says which dim, to what and where."""
    first = len(report.fallbacks)
    while True:
        symbols = _input_symbols(ep)
        try:
            _lower(ep, cfg, report)
        except Exception as e:  # noqa: BLE001 - as in a compile: the model as written, and the reason
            report.replacements.clear()
            report.fallbacks.append(Fallback("backend", f"{type(e).__name__}: {e}; exported the model as written"))
            return trace()
        fixed = _fixed_dims(symbols)
        if not fixed:
            return ep
        cfg = _without_families_of(cfg, fixed)
        report.replacements.clear()
        del report.fallbacks[first:]
        report.fallbacks.extend(Fallback(d.family or "backend", d.reason()) for d in fixed)
        report.patterns, first = tuple(sorted(cfg.patterns)), len(report.fallbacks)
        ep = trace()


MIN_OPSET = 18  # torch.onnx's dynamo exporter has no implementations below it (it would convert down, op by op)


def export(model, args, f=None, *, kwargs=None, dynamic_shapes=None, opset_version=None, functions: bool = True,
           report: bool = True, strict: bool | None = None, external_data: bool | None = None) -> ExportResult:
    """Export `model(*args, **kwargs)` to ONNX with each fused region as one `xaccel` node.

    dynamic_shapes: torch.export's, kept symbolic in the ONNX graph. functions: attach each node's
    body (standard ONNX ops) so that any onnxruntime runs the file; False leaves the bare custom
    nodes for a runtime that implements the domain. report: log what was fused and what was not
    (INFO, logger "torch_xaccel.onnx"; nothing is printed). external_data: how `f` is written,
    as ExportResult.save does (None: the weights in `<f's name>.data` beside it where one file
    would pass protobuf's 2 GB limit). strict: True traces with Dynamo (torch.export's strict
    mode), which applies torch.compile's library substitutions (xlstm's and FlashRNN's sLSTM
    loops, the mLSTM library calls); False traces without it; None (default): Dynamo, and
    non-strict where Dynamo fails. (Dynamo's export keeps a copy of every weight it meets: for a
    model whose weights fill memory, strict=False.)
    Returns an ExportResult (the ONNXProgram, the path, the report, the xaccel node counts; its
    `model` the ModelProto, its save(path, external_data=None) writes it again)."""

    if opset_version is not None and opset_version < MIN_OPSET:
        raise ValueError(f"torch_xaccel.onnx.export: opset_version {opset_version} is not supported: torch.onnx "
                         f"exports from opset {MIN_OPSET} on (the ops' bodies are exported at the model's opset)")
    cfg = config.load()
    graph_report = new_graph_report()
    ok, missing = _exportable_patterns(cfg)
    cfg = dataclasses.replace(cfg, patterns=frozenset(ok))
    graph_report.patterns = tuple(sorted(ok))
    for pattern in missing:
        graph_report.fallbacks.append(Fallback(families.family_of(pattern).name, f"pattern {pattern}: its ops have no "
                                               "ONNX body yet; its code exports as standard ONNX"))
    ep = _exported(model, tuple(args), kwargs, dynamic_shapes, strict, graph_report)
    if not cfg.disable:  # a second trace repeats the first one's notes, which the report holds already
        ep = _lowered(ep, cfg, graph_report, lambda: _exported(model, tuple(args), kwargs, dynamic_shapes, strict,
                                                               types.SimpleNamespace(fallbacks=[])))
    _check_translatable(ep)
    with bodies.quiet_exporter():
        ep = ep.run_decompositions({op: symbolic.decomposition(op) for op in bodies.translatable_ops()})
        program = torch.onnx.export(ep, dynamo=True, opset_version=opset_version, dynamic_shapes=dynamic_shapes,
                                    verbose=False)
    proto = without_weights(program.model)  # (the weights stay the model's tensors: nothing copied)
    counts = bodies.attach(proto) if functions else bodies.count(proto)
    _copy_functions(proto, program.model)
    result = ExportResult(program, None, Report(graphs=[graph_report]), counts)
    if f is not None:
        result.save(f, external_data)
    if report:
        logger.info("%s", result)
    return result
