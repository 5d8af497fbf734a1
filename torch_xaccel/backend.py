"""The `xaccel` torch.compile backend (found through the torch_dynamo_backends entry point).

Dynamo graph -> ATen pre-dispatch IR -> pattern passes -> aot_autograd (xaccel ops bring their own
backward) -> the rest runs eagerly, or through Inductor with XACCEL_FALLBACK=inductor.
Any exception in that pipeline is reported and the captured graph runs unmodified: compiling never
fails because of xaccel. (An invalid setting is the one exception: an XACCEL_* variable, an
`xaccel.*` option or an Inductor option that does not hold raises XaccelConfigError, which
reaches the compiled model's caller as itself: errors.at_compile.)

Settings (config.py): the environment, then config.patch, then torch.compile's `xaccel.*`
options; its other options (and mode=) are Inductor's (modes.py). The report goes to the
`torch_xaccel` logger (logs.py; TORCH_LOGS="xaccel"), never to stdout.

This module must not call torch._dynamo.register_backend for "xaccel": torch loads it from the entry
point and registers the function itself; a second registration fails with "duplicate name".
"""
from __future__ import annotations

import contextlib
import copy
import logging
import warnings

import torch

# Dynamo's own control flow (restart the analysis with other choices): raised through the backend
# by aot_autograd's passes or by us, never swallowed as a backend failure
from torch._dynamo.exc import RestartAnalysis as _RestartAnalysis, TensorifyScalarRestartAnalysis

from . import (
    choice,
    config as _config,
    distributed,
    eager_calls,
    families,
    gradient_sums,
    logs,
    ops,  # noqa: F401  (registers torch.ops.xaccel.*)
    regions,
)
from .codegen import precision
from .errors import XaccelConfigError, XaccelFallbackWarning, at_compile
from .modes import CUDAGRAPHS, describe, rest_options, warn_inductor_only
from .report import Fallback, new_graph_report, publish

families.install_trace_hooks()  # before Dynamo traces anything for this backend
distributed.prefer_whole_graphs()  # under DDP, whole graphs: optimize_ddp True -> False (distributed.py)


def _pointwise_ops(g: torch.fx.GraphModule) -> int:
    return sum(1 for n in g.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and torch.Tag.pointwise in n.target.tags)


def _carry_dynamo_metadata(dynamo_gm: torch.fx.GraphModule, lowered: torch.fx.GraphModule) -> None:
    """Give the lowered graph the Dynamo metadata that aot_autograd reads to find static inputs
    (the compile id, each placeholder's source and tensor marks): without it Inductor's CUDA
    graphs (mode="reduce-overhead" with XACCEL_FALLBACK=inductor) treat a module's parameters as
    ordinary inputs and copy every weight into the graph's buffers on each replay. Carried only
    when the graphs have matching placeholders and the lowered one holds no parameters or buffers
    of its own (aot_autograd needs a Dynamo source for each)."""
    old = list(dynamo_gm.graph.find_nodes(op="placeholder"))
    new = list(lowered.graph.find_nodes(op="placeholder"))
    owned = [*lowered.named_parameters(remove_duplicate=False), *lowered.named_buffers(remove_duplicate=False)]
    if ("dynamo_compile_id" not in dynamo_gm.meta or len(old) != len(new) or owned
            or not all(hasattr(o, "_dynamo_source") for o in old)):  # aot_autograd asserts each has one
        return
    for o, n in zip(old, new):
        n._dynamo_source = o._dynamo_source
        if "tensor_dict" in o.meta:
            n.meta["tensor_dict"] = o.meta["tensor_dict"]
    if hasattr(dynamo_gm, "_param_name_to_source"):
        lowered._param_name_to_source = dynamo_gm._param_name_to_source
    lowered.meta["dynamo_compile_id"] = dynamo_gm.meta["dynamo_compile_id"]


def _compile_rest(gm: torch.fx.GraphModule, example_inputs, fallback: str, patches: dict, backward_pass=None,
                  rest_pass=None):
    """Run the lowered graph: through Inductor (with torch.compile's mode/options as config
    patches), or eagerly. Eagerly under CUDA graphs when the mode asks for them (torch's CUDA graph
    trees, with parameters kept in place: graphed_rest.py; they skip graphs with CPU tensors and
    say why). Eagerly with grad mode off (Dynamo guards on it and recompiles when it changes), the
    ATen graph runs as it is: without autograd aot_autograd adds nothing but a second trace of the
    whole graph (a noticeable share of a large model's first call) and a per-call wrapper.
    backward_pass (eager only): rewrites the backward graph before it runs (the families' backward
    passes); Inductor fuses the backward's elementwise ops itself. rest_pass (eager only, without
    CUDA graphs): rewrites every graph that runs eagerly, last (the families' rest passes)."""
    rest = rest_pass or (lambda g, _name: g)
    overrides = _config.active_overrides()  # the compile's options, for the backward's kernels too
    if fallback == "inductor":
        from torch._inductor.compile_fx import compile_fx

        from .inductor_cache import prepare

        if not _holds_xaccel_ops(gm):  # the captured graph as it is
            return compile_fx(gm, example_inputs, config_patches=prepare(gm, patches))
        # a graph with xaccel ops: without donated buffers. With them, aot_autograd let the backward write
        # into a saved tensor that is also a forward output (a model's logits, overwritten by its
        # gradient) in a lowered graph with regions put back (transformers' xLSTM train step)
        import torch._functorch.config as functorch_config

        with functorch_config.patch(donated_buffer=False):
            return compile_fx(gm, example_inputs, config_patches=prepare(gm, patches, "-no-donated-buffers"))
    if patches.get(CUDAGRAPHS):
        from .graphed_rest import compile_graphed

        return compile_graphed(gm, example_inputs)
    if not torch.is_grad_enabled():  # (grad mode on: xaccel ops called directly would drop their backward)
        return eager_calls.rewrite(rest(gm, "inference")).forward
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def run_eagerly(g, _inputs):
        return make_boxed_func(eager_calls.rewrite(rest(g, "forward")).forward)

    def run_backward(g, _inputs):
        if backward_pass is not None:
            g = backward_pass(g)
        return make_boxed_func(_config.calling_with(eager_calls.rewrite(rest(g, "backward")).forward, overrides))

    return aot_autograd(fw_compiler=run_eagerly, bw_compiler=run_backward)(gm, example_inputs)


def _backward_pass(cfg, report):
    """The families' passes over the backward graph (families.py; the gemm_epilogue family's GEMM
    chains, XACCEL_BACKWARD_FUSION), then gradient_sums' rewrites (sums of padded slice gradients
    as one cat; sums folded into the ops that take an addend). They run at the first backward
    call: a failure there is reported and the backward graph runs as traced, as a forward failure
    would."""
    passes = [p for p in (families.resolve(f.backward_pass)(cfg) for f in families.FAMILIES if f.backward_pass) if p]
    passes.append(lambda g, _report: gradient_sums.rewrite(g))
    addends = families.addend_args()
    passes.append(lambda g, _report: gradient_sums.fold_into_producers(g, addends))

    def fuse(g: torch.fx.GraphModule) -> torch.fx.GraphModule:
        try:
            fused = copy.deepcopy(g)
            for run in passes:
                fused = run(fused, report)
            return fused
        except Exception as e:  # noqa: BLE001 - never fail because of xaccel
            report.fallbacks.append(Fallback("backend", f"backward graph: {type(e).__name__}: {e}; ran it as traced"))
            warnings.warn(f"xaccel: backward pass failed ({type(e).__name__}: {e}); "
                          "running the backward graph as traced",
                          XaccelFallbackWarning, stacklevel=2)
            return g
    return fuse


def _copied(g: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A module over a copy of g's graph (the nodes' metadata shared, not deep-copied: an inference
    graph's fake values cannot be), so that a pass that fails leaves g as it was."""
    graph = torch.fx.Graph(tracer_cls=g.graph._tracer_cls)
    graph.output(graph.graph_copy(g.graph, {}))
    return torch.fx.GraphModule(g, graph)


def _rest_pass(cfg, report):
    """The families' rest passes (families.py; the pointwise family's groups) as one rewrite of a
    graph that runs eagerly, or None where none is enabled. A failure is reported and the graph
    runs as it was."""
    passes = [(p, families.resolve(path)) for p, path in families.rest_passes(cfg.patterns)]
    if not passes:
        return None

    def rewrite(g: torch.fx.GraphModule, graph_name: str) -> torch.fx.GraphModule:
        try:
            fused = _copied(g)
            for _pattern, run in passes:
                run(fused, report, graph_name)
            return fused
        except Exception as e:  # noqa: BLE001 - never fail because of xaccel
            report.fallbacks.append(Fallback("backend", f"{graph_name} graph's rest pass: {type(e).__name__}: {e}; "
                                                        "ran it as it was"))
            warnings.warn(f"xaccel: rest pass failed on the {graph_name} graph ({type(e).__name__}: {e}); "
                          "running it as it was", XaccelFallbackWarning, stacklevel=2)
            return g
    return rewrite


def _specialize_float_inputs(gm: torch.fx.GraphModule) -> bool:
    """Ask Dynamo to specialize the graph's unspecialized Python-float inputs (dynamic=True makes
    a float argument, e.g. a norm's eps, a 0-d tensor input read back with .item()): the ATen trace
    cannot use such a value where an op needs a concrete number. Returns whether any input was
    newly marked; the caller then raises Dynamo's restart, which retraces with those floats as
    constants (guarded on their values)."""
    try:
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:
        return False
    marked = False
    for node in gm.graph.find_nodes(op="placeholder"):
        memo = getattr(node.meta.get("example_value"), "item_memo", None)
        name = getattr(getattr(getattr(memo, "node", None), "_expr", None), "name", None)
        if isinstance(name, str) and not TensorifyState.should_specialize(name):
            TensorifyState.specialize(name)
            marked = True
    return marked


def _trace_to_aten(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """The Dynamo graph in ATen IR; a trace that fails where unspecialized float inputs exist
    restarts Dynamo with them specialized."""
    from .lowering.normalize import to_aten

    try:
        return to_aten(gm, example_inputs)
    except Exception as e:
        if _specialize_float_inputs(gm):
            raise TensorifyScalarRestartAnalysis from e
        raise


def plain_decode_steps(report, example_inputs, patches: dict) -> int:
    """The graph's decode-step replacements when it runs on CUDA without CUDA graphs (the
    report's hint), else 0."""
    if patches.get(CUDAGRAPHS) or not any(isinstance(t, torch.Tensor) and t.device.type == "cuda"
                                          for t in example_inputs):
        return 0
    return sum(r.op in families.DECODE_OPS for r in report.replacements)


def _choice_settings(cfg, patches: dict, training: bool) -> str:
    """What shapes a graph's candidates besides its code and inputs (part of its choice's key)."""
    return "|".join(str(x) for x in (
        sorted(cfg.patterns), cfg.fallback, *(getattr(cfg, s.name) for f in families.FAMILIES for s in f.settings),
        training, torch.is_grad_enabled(), sorted((k, repr(v)) for k, v in patches.items()),
        precision.torch_allows_tf32()))


def _xaccel_rests(cfg, choosing: bool) -> list[str]:
    """The rests the xaccel candidates run under: XACCEL_FALLBACK's, or with "auto" both when the
    choice is measured (else the eager rest)."""
    if cfg.fallback != "auto":
        return [cfg.fallback]
    return ["eager", "inductor"] if choosing else ["eager"]


def _candidates(gm, graphs: dict, example_inputs, cfg, patches, report, training, choosing) -> list:
    """The graph's candidates, unbuilt: each lowered graph under its rest (`graphs`: rest -> the
    lowered graph, its losing regions put back), and with the measured choice the captured graph
    under Inductor and as it is."""
    cands = []
    for rest, lowered in graphs.items():
        def build(rest=rest, lowered=lowered):
            g = _copied(lowered)  # each rest its own graph: compiling one must not change another's
            _carry_dynamo_metadata(gm, g)
            return _compile_rest(g, example_inputs, rest, patches,
                                 _backward_pass(cfg, report) if training else None, _rest_pass(cfg, report))
        cands.append(choice.Candidate(choice.xaccel_candidate(rest), build))
    if choosing:
        cands.append(choice.Candidate(choice.INDUCTOR, lambda: _compile_rest(gm, example_inputs, "inductor", patches)))
        cands.append(choice.Candidate(choice.EAGER, lambda: gm.forward))
    return cands


def _region_graphs(diff, example_inputs, training, rests, written, settings, report) -> dict:
    """rest -> the lowered graph with the regions that measured slower than their original beside
    that rest put back (regions.py, choice.choose_regions); a rest whose every region lost gets no
    xaccel candidate (the captured graph's candidates cover it), unless the captured graph itself
    calls xaccel ops. Not measured where the graph
    writes its inputs (running it at compile time would write them). A graph with regions put back
    must compute what the lowered one does on the example inputs (a check of the rewiring, not of
    numerics), else the lowered graph stays."""
    if diff is None:
        return {}
    if written:
        return dict.fromkeys(rests, diff.lowered)
    revert, report.region_choices = choice.choose_regions(diff, example_inputs, training, rests,
                                                         choice.device_of(example_inputs), settings)
    graphs = {}
    for rest in rests:
        if not revert[rest]:
            graphs[rest] = diff.lowered
        elif len(revert[rest]) < len(diff.regions) or _holds_xaccel_ops(diff.original):
            reverted = diff.revert(revert[rest])
            ok = reverted is not None and choice.same_outputs(reverted, diff.lowered, example_inputs)
            graphs[rest] = reverted if ok else diff.lowered
            if not ok:
                report.region_choices.append(f"beside the {rest} rest: kept every region (putting back "
                                             f"{len(revert[rest])} did not rewire cleanly)")
    return graphs


def _holds_xaccel_ops(gm: torch.fx.GraphModule) -> bool:
    """Whether a graph calls xaccel ops before any pass ran (library calls substituted while Dynamo
    traced): with every region put back, its xaccel candidates still differ from the captured
    graph's."""
    return any(n.op == "call_function" and str(n.target).startswith("xaccel.") for n in gm.graph.nodes)


def _run_unchosen(gm, lowered, example_inputs, cfg, patches, report, training):
    """XACCEL_CHOOSE=0 (or CUDA graphs): the lowered graph under XACCEL_FALLBACK's rest (eager for
    "auto"), or the captured graph when nothing was replaced."""
    rest = _xaccel_rests(cfg, False)[0]
    if not report.replacements:
        if rest == "eager" and not patches.get(CUDAGRAPHS):
            return gm.forward
        return _compile_rest(gm, example_inputs, rest, patches)
    _carry_dynamo_metadata(gm, lowered)
    return _compile_rest(lowered, example_inputs, rest, patches, _backward_pass(cfg, report) if training else None,
                         _rest_pass(cfg, report))


def xaccel_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """torch.compile(..., backend="xaccel"[, mode=..., options=...]): `xaccel.*` options are
    torch_xaccel's settings for this compile (config.py), the others and the mode Inductor's
    (modes.py)."""
    families.install_trace_hooks()  # a library imported after the backend loaded: its next trace
    try:
        overrides, inductor_options = _config.split_options(options.get("options"))
        cfg = _config.load(overrides)
        # an unknown mode or Inductor option raises, like an invalid XACCEL_* value
        patches = rest_options({**options, "options": inductor_options} if "options" in options else options)
    except XaccelConfigError as e:
        raise at_compile(e) from None  # (not wrapped by Dynamo: the user's except catches it)
    with _config.applying(overrides):  # kernel providers' config.current() during the compile
        compiled = _compile(gm, example_inputs, options, cfg, overrides, patches)
    return _config.calling_with(compiled, overrides)  # ... and at the graph's calls


def _compile(gm, example_inputs, options: dict, cfg, overrides: dict, patches: dict):
    if logs.log.isEnabledFor(logging.DEBUG):
        logs.log.debug("compiling a graph of %d nodes with %s", len(gm.graph.nodes), _config.describe(cfg, overrides))
    choosing = cfg.choose and not patches.get(CUDAGRAPHS)  # (CUDA graphs: not measured yet)
    # the rest the passes plan for: XACCEL_FALLBACK's, "auto" while the choice is open
    planned_rest = cfg.fallback if choosing or cfg.fallback != "auto" else "eager"
    if planned_rest == "eager":
        warn_inductor_only(patches)
    report = new_graph_report()
    report.force_log = cfg.log
    split = distributed.split_note(gm)  # one of the DDP optimizer's pieces: say so (distributed.py)
    if split:
        report.fallbacks.append(Fallback("ddp_split", split))
    report.fallback_backend, report.patterns = planned_rest, tuple(sorted(cfg.patterns))
    settings = describe(options.get("mode") or "default", patches, planned_rest)
    restarting = False
    try:
        if cfg.disable:
            report.disabled = True
            return gm.forward
        from .lowering import CONSTANT_FLOATS, PassContext, run_passes

        training = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)
        key, decided = None, None
        if choosing:
            device = choice.device_of(example_inputs)
            choice_settings = _choice_settings(cfg, patches, training)
            key = choice.graph_key(gm, example_inputs, choice_settings, device)
            decided = choice.stored(key)
            if decided is not None and decided["config"] in choice.ANCHORS:  # nothing of ours runs: no lowering
                report.chosen, report.choice = decided["config"], choice.describe(decided, cached=True)
                report.settings = settings
                anchor = _candidates(gm, {}, example_inputs, cfg, patches, report, training, True)
                with report.timing(f"build {decided['config']}"):
                    return next(c for c in anchor if c.name == decided["config"]).build()
        with report.timing("trace"):
            aten_gm = _trace_to_aten(gm, example_inputs)
        aten_gm.meta["xaccel_example_inputs"] = example_inputs  # real values, for checks of cached constants
        written = choice.written_inputs(aten_gm) if choosing else None  # (before passes rewrite the graph)
        original = None
        if choosing:
            regions.tag(aten_gm)
            original = regions.snapshot(aten_gm)
        ctx = PassContext(cfg, report, training)
        with regions.Replacements(aten_gm) if choosing else contextlib.nullcontext() as replacements:
            with report.timing("passes"):
                lowered = run_passes(aten_gm, ctx)
        if CONSTANT_FLOATS in ctx.requests and _specialize_float_inputs(gm):
            raise TensorifyScalarRestartAnalysis  # traced again with those floats as constants
        rests = _xaccel_rests(cfg, choosing)
        if "eager" in rests:  # only the eager rest leaves them unfused (the report's hint)
            report.eager_pointwise = _pointwise_ops(lowered)
        report.plain_decode_steps = plain_decode_steps(report, example_inputs, patches)
        if not choosing:
            report.settings = settings
            return _run_unchosen(gm, lowered, example_inputs, cfg, patches, report, training)
        with report.timing("regions"):
            graphs = _region_graphs(regions.Diff(original, lowered, replacements) if report.replacements else None,
                                    example_inputs, training, rests, written, choice_settings, report)
        cands = _candidates(gm, graphs, example_inputs, cfg, patches, report, training, True)
        report.settings = settings
        if decided is not None and any(c.name == decided["config"] for c in cands):
            report.chosen, report.choice = decided["config"], choice.describe(decided, cached=True)
            with report.timing(f"build {decided['config']}"):
                return next(c for c in cands if c.name == decided["config"]).build()
        for c in cands:
            with report.timing(f"build {c.name}"):
                c.make()
        return choice.Chooser(key, cands, training, device, report, written)
    except _RestartAnalysis:  # Dynamo traces the frame again and calls the backend anew
        restarting = True
        raise
    except Exception as e:  # noqa: BLE001 - the contract: never fail a compile because of xaccel
        report.replacements.clear()
        report.fallbacks.append(Fallback("backend", f"{type(e).__name__}: {e}; ran the captured graph unmodified"))
        warnings.warn(f"xaccel: backend failed ({type(e).__name__}: {e}); running the captured graph unmodified",
                      XaccelFallbackWarning, stacklevel=2)
        return gm.forward
    finally:
        if not restarting:
            publish(report)  # (and logged: TORCH_LOGS="xaccel" or XACCEL_LOG=1)
