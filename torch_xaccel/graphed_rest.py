"""The eager rest under CUDA graph trees: mode="reduce-overhead" with XACCEL_FALLBACK=eager.

torch's `cudagraphs` backend treats only the arguments that aot_autograd lifted as static. With nn
modules inlined (torch's default) a model's parameters are ordinary graph inputs, so it copies
every weight into the graph's own buffers before each replay, which makes a graphed decode step
much slower than a hand-captured graph of the same model (docs/benchmarks.md). For graphs without
autograd (decoding, inference) this module graphs the inference graph itself and keeps static
what aot_autograd lists as static (the backend carries Dynamo's metadata to the lowered graph for
it), or, where that list is missing, what Dynamo marked on the tensors themselves (parameters and
buffers of inlined modules, `_dynamo_static_input_type`): as Inductor keeps them. The graph trees
re-record if one of them moves. Graphs with autograd keep torch's backend.
"""
from __future__ import annotations

import warnings

import torch


def compile_graphed(gm: torch.fx.GraphModule, example_inputs):
    from torch._dynamo.backends.cudagraphs import cudagraphs

    if torch.is_grad_enabled():
        return cudagraphs(gm, example_inputs)
    try:
        from torch._dynamo.backends.common import aot_autograd

        def inference(aot_gm, aot_inputs):
            return _graphed(aot_gm, aot_inputs, example_inputs)
        return aot_autograd(fw_compiler=inference, inference_compiler=inference)(gm, example_inputs)
    except (ImportError, AttributeError, TypeError) as e:  # torch internals moved: torch's own backend still works
        warnings.warn(f"xaccel: static-parameter CUDA graphs unavailable ({type(e).__name__}: {e}); "
                      "torch's cudagraphs backend copies the weights on every replay", UserWarning, stacklevel=2)
        return cudagraphs(gm, example_inputs)


def static_inputs(example_inputs: list, n_aot: int) -> list[int]:
    """Inputs the graph trees may keep in place, as indices into aot_autograd's arguments (the
    ones it lifted, then Dynamo's): aot_autograd's own list when it has one, else the lifted
    ones and the tensors Dynamo marked static."""
    ctx = torch._guards.TracingContext.try_get()
    listed = getattr(getattr(ctx, "fw_metadata", None), "static_input_indices", None)
    if listed:
        return sorted(listed)
    lifted = _lifted(len(example_inputs), n_aot)
    marked = [lifted + j for j, t in enumerate(example_inputs)
              if isinstance(t, torch.Tensor) and (isinstance(t, torch.nn.Parameter)
                                                   or getattr(t, "_dynamo_static_input_type", None))]
    return list(range(lifted)) + marked


def _lifted(n_dynamo: int, n_aot: int) -> int:
    """Arguments aot_autograd put before Dynamo's (lifted parameters; not its RNG seed/offset
    inputs, which torch's helper subtracts)."""
    try:
        from torch._inductor.utils import num_fw_fixed_arguments

        return num_fw_fixed_arguments(n_dynamo, n_aot)
    except ImportError:
        return n_aot - n_dynamo


def _graphed(aot_gm: torch.fx.GraphModule, aot_inputs: list, example_inputs: list):
    from torch._dynamo.backends.cudagraphs import (
        check_for_skip,
        find_input_mutations,
        get_device_index,
        get_stack_traces,
    )
    from torch._inductor.cudagraph_trees import cudagraphify_impl
    from torch._inductor.cudagraph_utils import get_placeholder_info, log_cudagraph_skip_and_bump_counter

    run = boxed_clearing(aot_gm)
    static = static_inputs(example_inputs, len(aot_inputs))
    skip = check_for_skip(aot_gm, _lifted(len(example_inputs), len(aot_inputs)))
    if skip:  # e.g. CPU tensors: logged and counted (counters["inductor"]["cudagraph_skips"])
        log_cudagraph_skip_and_bump_counter(skip)
        return run
    graphed = cudagraphify_impl(run, aot_inputs, static,
                                device_index=get_device_index(aot_gm), is_backward=False, is_inference=True,
                                stack_traces=get_stack_traces(aot_gm), placeholders=get_placeholder_info(aot_gm.graph),
                                mutated_input_idxs=find_input_mutations(aot_gm.graph))
    graphed._boxed_call = True
    return graphed


def boxed_clearing(gm: torch.fx.GraphModule):
    """The graph as a boxed function that empties its argument list, as the graph trees require
    (they assert the list is empty after the warm-up run, so inputs they do not own can be freed;
    functorch's make_boxed_func leaves it full)."""
    def run(args: list):
        inputs = list(args)
        args.clear()
        return gm(*inputs)
    run._boxed_call = True
    return run
