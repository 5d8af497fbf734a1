"""The model suite: whole models compiled with xaccel against their own fast paths. xLSTMLarge at 7B
widths against the xlstm package's Triton kernels, and transformers' xLSTMForCausalLM (the xlstm
package hidden) against eager: prefill, train step and one-token decode. Also the model builders
the sLSTM suite and the sweep share (xlstm_block_stack, transformers_xlstm_without_package)."""
from __future__ import annotations

import os
import re
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F

from torch_xaccel.bench import common
from torch_xaccel.bench.common import Case, _bench, _bench_calls, _empty_cache, _graphed, _ratios_to_first, _sync


def xlstm_block_stack(E, blocks, slstm_at, backend, B, S, heads=4):
    """The xlstm package's xLSTMBlockStack (mLSTM blocks, sLSTM blocks at `slstm_at` on `backend`),
    in fp32 on the CPU, with random recurrent weights."""
    from xlstm import (
        mLSTMBlockConfig,
        mLSTMLayerConfig,
        sLSTMBlockConfig,
        sLSTMLayerConfig,
        xLSTMBlockStack,
        xLSTMBlockStackConfig,
    )

    cfg = xLSTMBlockStackConfig(
        mlstm_block=mLSTMBlockConfig(mlstm=mLSTMLayerConfig(conv1d_kernel_size=4, qkv_proj_blocksize=4,
                                                            num_heads=heads)),
        slstm_block=sLSTMBlockConfig(slstm=sLSTMLayerConfig(backend=backend, num_heads=heads, conv1d_kernel_size=4,
                                                            batch_size=B)),
        context_length=S, num_blocks=blocks, embedding_dim=E, slstm_at=list(slstm_at))
    model = xLSTMBlockStack(cfg)
    with torch.no_grad():  # the package initialises R to zeros: random recurrent weights exercise the recurrence
        for name, p in model.named_parameters():
            if "recurrent" in name:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return model


# the xlstm package's kernel settings: its pure-PyTorch configuration, which xaccel compiles, and
# its own Triton kernels (the anchor); the benchmarks/ scripts use the same two
NATIVE_KERNELS = dict(chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
                      step_kernel="native")
ANCHOR_KERNELS = dict(chunkwise_kernel="chunkwise--triton_limit_chunk", sequence_kernel="native_sequence__triton",
                      step_kernel="triton")


def xlstm_model(B=4, S=2048, quick=False):
    """xLSTMLarge at 7B widths (embedding 4096, 8 heads, 4 blocks, vocab 50304), bf16: prefill, a
    train step and one-token decode latency at batch 1 and 8 (plain and in a CUDA graph), for the
    xlstm package's Triton configuration (the anchor) and its native configuration compiled with
    backend="xaccel". `--quick` shrinks it (and runs on a CPU as a smoke test of the code path)."""
    dims = dict(embedding_dim=4096, num_heads=8, num_blocks=4)
    if quick:
        dims = dict(embedding_dim=1024, num_heads=4, num_blocks=2) if torch.cuda.is_available() else \
            dict(embedding_dim=256, num_heads=2, num_blocks=2)
    return Case(f"xLSTMLarge {dims['embedding_dim']}x{dims['num_blocks']} B{B} S{S} bf16", B * S,
                lambda: (dims, B, S), runner=run_model_case)


def run_model_case(case: Case) -> list:
    """Rows per configuration: prefill (inference mode) and train step (fwd + bwd + CE loss), with
    first-call (compile) time. 'TFLOP/s' here is k tokens/s."""
    (dims, B, S), rows = case.make(), []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = torch.randint(0, 50304, (B, S), device=dev)

    def add(path, ms, extra="", tokens=None):
        tokens = tokens or case.flop
        rows.append(dict(case=case.name, path=path, ms=ms, tflops=tokens / ms / 1e3, extra=extra))
        print(f"  {path:52s} {ms:9.3f} ms  {tokens / ms:8.1f} k tok/s  {extra}", flush=True)

    native = NATIVE_KERNELS
    ro = {"mode": "reduce-overhead"}
    configs = {  # name: (the model's kernel settings, XACCEL_* set while it compiles, torch.compile kwargs)
        "xlstm Triton kernels (anchor)": (ANCHOR_KERNELS, {}, {}),
        "native kernels + xaccel": (native, {"XACCEL_FALLBACK": "eager"}, {}),
        "native kernels + xaccel, rest by Inductor": (native, {"XACCEL_FALLBACK": "inductor"}, {}),
        # CUDA graph trees inside the compiled function: decode rows (the default --paths skips them
        # for prefill and train, which are not launch-bound)
        "native kernels + xaccel, mode=reduce-overhead": (native, {"XACCEL_FALLBACK": "eager"}, ro),
        "native kernels + xaccel, rest by Inductor, mode=reduce-overhead":
            (native, {"XACCEL_FALLBACK": "inductor"}, ro),
    }
    for name, (kernels, env, kwargs) in configs.items():
        with mock.patch.dict(os.environ, env):  # restored afterwards, unset ones removed again
            _model_config_rows(name, kernels, dims, dev, tokens, add, kwargs)
    return _ratios_to_first(rows)


def _settle_cutlass(run) -> str:
    """After a cold first call with XACCEL_CUTLASS=1, CUTLASS kernels build in the background and
    their cases retune at a later call: wait for the builds, then retune in one untimed call, so
    the timing that follows is the steady state (and not a retune inside do_bench's warm-up)."""
    from torch_xaccel.codegen.gemm_epilogue import triton_kernels as gemm_kernels

    t0 = time.perf_counter()
    cases = gemm_kernels.settle()
    if not cases:
        return ""
    run()
    _sync()
    return f", then {time.perf_counter() - t0:.0f}s for {cases} case(s)' background CUTLASS builds and their retuning"


def _model_config_rows(name, kernels, dims, dev, tokens, add, compile_kwargs) -> None:
    """Prefill, train step and decode rows of one configuration (those whose label matches --paths;
    with a torch.compile mode, decode rows only unless --paths names the others; the train step
    with its loss compiled too only when --paths names it)."""
    import torch._dynamo
    from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

    def wanted(label):
        if compile_kwargs and not common.PATHS and "decode" not in label:
            return False
        if "loss compiled" in label and not common.PATHS:  # opt-in: --paths names it
            return False
        return re.search(common.PATHS, f"{name}, {label}") is not None

    def loss(logits):  # the train step's loss, as a user writes it around the model
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    # "loss compiled": the same step with the cross-entropy inside the compiled function (xaccel:
    # model and loss in one torch.compile; the anchor: its loss alone compiled by Inductor), to
    # show what compiling the loss too is worth (the LM head's logits cast and softmax)
    for label, mode in (("prefill", "inference"), ("train step", "train"), ("train step, loss compiled", "train")):
        if not wanted(label):
            continue
        torch._dynamo.reset()
        try:
            # xlstm 2.0.6's train mode needs return_last_states=True (else the layer unpacks h)
            cfg = xLSTMLargeConfig(vocab_size=50304, chunk_size=64, mode=mode, return_last_states=mode == "train",
                                   **dims, **kernels)
            torch.manual_seed(0)
            model = xLSTMLarge(cfg).to(dev, torch.bfloat16)
            if "loss compiled" in label and "xaccel" in name:
                step = torch.compile(lambda t: loss(model(t)[0]), backend="xaccel", **compile_kwargs)
            elif "loss compiled" in label:
                compiled_loss = torch.compile(loss)
                step = lambda t: compiled_loss(model(t)[0])  # noqa: E731
            else:
                fn = torch.compile(model, backend="xaccel", **compile_kwargs) if "xaccel" in name else model
                step = lambda t: loss(fn(t)[0])  # noqa: E731
            if mode == "inference":
                def run():
                    with torch.inference_mode():
                        return fn(tokens)
            else:
                def run():
                    model.zero_grad(set_to_none=True)
                    step(tokens).backward()
            t0 = time.perf_counter()
            run()
            _sync()
            first = time.perf_counter() - t0
            extra = f"first call {first:.1f}s"
            if "xaccel" in name:
                extra += _settle_cutlass(run)
            ms, calls = _bench_calls(run, True)
            add(f"{name}, {label}", ms, f"{extra}; {len(calls)} timed calls, {min(calls):.1f}-{max(calls):.1f} ms")
        except Exception as e:  # noqa: BLE001 - a configuration that fails is a finding
            print(f"  {name}, {label}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        _empty_cache()
    for b in (1, 8):  # one-token latency after a 64-token prompt, plain and in a CUDA graph
        if not wanted(f"decode B{b}"):
            continue
        torch._dynamo.reset()
        try:
            cfg = xLSTMLargeConfig(vocab_size=50304, chunk_size=64, mode="inference", return_last_states=True,
                                   **dims, **kernels)
            torch.manual_seed(0)
            model = xLSTMLarge(cfg).to(dev, torch.bfloat16)
            fn = torch.compile(model, backend="xaccel", **compile_kwargs) if "xaccel" in name else model
            with torch.inference_mode():
                _, state = fn(torch.randint(0, 50304, (b, 64), device=dev))
                # a copy: under mode=reduce-overhead the prefill's outputs live in CUDA-graph memory
                # that a later run may reuse
                state = {blk: tuple(t.clone() for t in st) for blk, st in state.items()}
                tok = torch.randint(0, 50304, (b, 1), device=dev)
                t0 = time.perf_counter()
                fn(tok, state)
                _sync()
                first = time.perf_counter() - t0
                add(f"{name}, decode B{b} one token", _bench(lambda: fn(tok, state), False), f"first call {first:.1f}s",
                    tokens=b)
                if dev == "cuda" and not compile_kwargs:  # (reduce-overhead graphs itself)
                    add(f"{name}, decode B{b} one token, CUDA graph", _bench(_graphed(lambda: fn(tok, state)), False),
                        tokens=b)
        except Exception as e:  # noqa: BLE001
            print(f"  {name}, decode B{b}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        _empty_cache()


TRANSFORMERS_XLSTM = "transformers.models.xlstm.modeling_xlstm"


def transformers_xlstm_without_package():
    """transformers' xlstm module as a user without the xlstm package gets it (its in-file copy of
    the chunkwise, sequence and step kernels), also where the package is installed: the file
    imported afresh under another name (Dynamo looks functions up by module name) while
    transformers' availability check answers no and `import xlstm` fails."""
    import importlib.util

    import transformers

    name = TRANSFORMERS_XLSTM + "_without_xlstm"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, importlib.util.find_spec(TRANSFORMERS_XLSTM).origin)
        module = importlib.util.module_from_spec(spec)
        package = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "xlstm" or k.startswith("xlstm.")}
        sys.modules["xlstm"] = None  # import xlstm fails, as where it is not installed
        sys.modules[name] = module  # (its classes' docstrings are built from the module's file)
        try:
            with mock.patch.object(transformers.utils, "is_xlstm_available", lambda: False):
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        finally:
            del sys.modules["xlstm"]
            sys.modules.update(package)
    return sys.modules[name]


def transformers_cache(modeling, cache=None) -> dict:
    """The keyword that hands xLSTMForCausalLM its cache: `cache` from transformers 5.24 on,
    `cache_params` before."""
    import inspect

    key = "cache" if "cache" in inspect.signature(modeling.xLSTMForCausalLM.forward).parameters else "cache_params"
    return {key: cache}


def transformers_cache_of(output):
    """The cache an xLSTMForCausalLM call returned (`cache` or, before 5.24, `cache_params`)."""
    return output.get("cache", output.get("cache_params"))


def transformers_cache_copy(cache):
    """The cache with its state tensors copied: under mode="reduce-overhead" the prefill's outputs
    live in CUDA-graph memory that a later replay may overwrite."""
    cache.rnn_state = {layer: tuple(t.clone() for t in state) for layer, state in cache.rnn_state.items()}
    if isinstance(getattr(cache, "seqlen_offset", None), torch.Tensor):
        cache.seqlen_offset = cache.seqlen_offset.clone()
    return cache


def transformers_model(B=4, S=2048, quick=False):
    """transformers' xLSTMForCausalLM at 7B widths (hidden 4096, 8 heads, 4 blocks, vocab 50304),
    bf16, its in-file mLSTM kernels (the xlstm package hidden): eager (the anchor) against
    compiled with backend="xaccel"; prefill, train step and one-token decode through its cache."""
    dims = dict(hidden_size=4096, num_heads=8, num_blocks=4)
    if quick:
        dims = dict(hidden_size=1024, num_heads=4, num_blocks=2) if torch.cuda.is_available() else \
            dict(hidden_size=256, num_heads=2, num_blocks=2)
    return Case(f"transformers xLSTMForCausalLM {dims['hidden_size']}x{dims['num_blocks']} B{B} S{S} bf16, "
                "without the xlstm package", B * S, lambda: (dims, B, S), runner=run_transformers_model_case)


def run_transformers_model_case(case: Case) -> list:
    """Rows per configuration, as run_model_case: prefill (use_cache=True, as generate() runs it:
    without a cache transformers' bf16 inference path fails eagerly, its fp32 zero start states
    meeting bf16 keys), train step (cross-
    entropy of the logits, backward) and one-token decode at batch 1 and 8 after a 64-token
    prompt, plain (and, eagerly, also replayed from a CUDA graph)."""
    (dims, B, S), rows = case.make(), []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = torch.randint(0, 50304, (B, S), device=dev)
    modeling = transformers_xlstm_without_package()

    def add(path, ms, extra="", tokens=None):
        tokens = tokens or case.flop
        rows.append(dict(case=case.name, path=path, ms=ms, tflops=tokens / ms / 1e3, extra=extra))
        print(f"  {path:52s} {ms:9.3f} ms  {tokens / ms:8.1f} k tok/s  {extra}", flush=True)

    print(f"\n{case.name}", flush=True)
    ro = {"mode": "reduce-overhead"}
    configs = {  # name: (XACCEL_* set while it compiles, torch.compile kwargs; None: uncompiled)
        "transformers eager (anchor)": ({}, None),
        "transformers + xaccel": ({"XACCEL_FALLBACK": "eager"}, {"backend": "xaccel"}),
        "transformers + xaccel, rest by Inductor": ({"XACCEL_FALLBACK": "inductor"}, {"backend": "xaccel"}),
        "transformers + xaccel, mode=reduce-overhead": ({"XACCEL_FALLBACK": "eager"}, {"backend": "xaccel", **ro}),
        "transformers + Inductor, mode=reduce-overhead": ({}, ro),
    }
    for name, (env, kwargs) in configs.items():
        with mock.patch.dict(os.environ, env):
            _transformers_config_rows(modeling, name, kwargs, dims, dev, tokens, add)
    return _ratios_to_first(rows)


def _transformers_config_rows(modeling, name, compile_kwargs, dims, dev, tokens, add) -> None:
    """One configuration's rows (those --paths selects; under a torch.compile mode decode only)."""
    import torch._dynamo

    def wanted(label):
        if compile_kwargs and "mode" in compile_kwargs and not common.PATHS and "decode" not in label:
            return False
        return re.search(common.PATHS, f"{name}, {label}") is not None

    def build(mode):
        cfg = modeling.xLSTMConfig(vocab_size=50304, chunk_size=64, mode=mode, use_cache=False, **dims)
        torch.manual_seed(0)
        model = modeling.xLSTMForCausalLM(cfg).to(dev, torch.bfloat16)
        return model, (model if compile_kwargs is None else torch.compile(model, **compile_kwargs))

    def timed_first(run) -> str:
        """The first call's time, and what the graphs it compiled replaced."""
        from torch_xaccel.report import Report, last_report

        before = len(last_report().graphs)
        t0 = time.perf_counter()
        run()
        _sync()
        first = f"first call {time.perf_counter() - t0:.1f}s"
        counts = Report(graphs=last_report().graphs[before:]).counts()
        return first + (f", replaced {({k: v for k, v in counts.items() if v})}" if compile_kwargs else "")

    for label, mode in (("prefill", "inference"), ("train step", "train")):
        if not wanted(label):
            continue
        torch._dynamo.reset()
        try:
            model, fn = build(mode)
            if mode == "inference":
                model.eval()

                def run():
                    with torch.inference_mode():
                        return fn(tokens, use_cache=True).logits
            else:
                model.train()

                def run():
                    model.zero_grad(set_to_none=True)
                    logits = fn(tokens).logits
                    F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
            extra = timed_first(run) + (_settle_cutlass(run) if compile_kwargs else "")
            ms, calls = _bench_calls(run, True)
            add(f"{name}, {label}", ms, f"{extra}; {len(calls)} timed calls, {min(calls):.1f}-{max(calls):.1f} ms")
        except Exception as e:  # noqa: BLE001 - a configuration that fails is a finding
            print(f"  {name}, {label}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        model = fn = None
        _empty_cache()
    for b in (1, 8):
        if not wanted(f"decode B{b}"):
            continue
        torch._dynamo.reset()
        try:
            model, fn = build("inference")
            model.eval()
            with torch.inference_mode():
                prompt = fn(torch.randint(0, 50304, (b, 64), device=dev), use_cache=True)
                cache = transformers_cache_copy(transformers_cache_of(prompt))
                tok = torch.randint(0, 50304, (b, 1), device=dev)
                kw = dict(use_cache=True, **transformers_cache(modeling, cache))

                def step():
                    return fn(tok, **kw).logits
                extra = timed_first(step)
                add(f"{name}, decode B{b} one token", _bench(step, False), extra, tokens=b)
                if dev == "cuda" and compile_kwargs is None:
                    add(f"{name}, decode B{b} one token, CUDA graph", _bench(_graphed(step), False), tokens=b)
        except Exception as e:  # noqa: BLE001
            print(f"  {name}, decode B{b}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        model = fn = None
        _empty_cache()


def cases(quick: bool) -> list[Case]:
    if not quick:
        return [xlstm_model(), transformers_model()]
    S = 512 if torch.cuda.is_available() else 128
    return [xlstm_model(quick=True, B=2, S=S), transformers_model(quick=True, B=2, S=S)]
