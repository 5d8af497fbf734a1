"""Which CUTLASS kernels will a GPU run of the whole-model bench build, and can they be built ahead?

Build, on a machine without the GPU, the CUTLASS kernels that a GPU run of the whole-model bench
will time, so that the device's time goes to timing and not to nvcc (each build is slow, and the
xLSTMLarge train step needs dozens of them).

A kernel's source depends on the epilogue, the dtypes, the operands' broadcasts and the B layout,
not on M, N or K. So the model compiles and runs once here on the CPU, in bf16, at its real widths
(one block, 320 tokens), with XACCEL_BACKWARD_FUSION=1 as on an sm_90 GPU; every gemm_epilogue
call that CUTLASS could serve on the GPU is recorded and its configs (gemm_kernels.cutlass_configs)
are built into the cache (XACCEL_CACHE_DIR; carry the `cutlass/` folder to the device). nvcc must
match the device's. The vocabulary is cut to 1024 (the LM head's chain does not depend on it, and
CPU bf16 GEMMs at the full 50304 are slow).

transformers' xLSTMForCausalLM (`transformers`, without the xlstm package, as `bench model` runs it)
has chains of its own (a softcapped gate projection with bias, its out projection's layout).

    XACCEL_CACHE_DIR=.xcache python benchmarks/cutlass_prebuild.py [transformers] [prefill] [train]
"""
import os
import sys

import torch

from torch_xaccel.codegen.gemm_epilogue import cutlass_kernels, triton_kernels as gemm_kernels
from torch_xaccel.ops.gemm_epilogue import reference


def record_cases(jobs: dict, stats: dict):
    """Wrap the op's reference so each call adds its CUTLASS sources to jobs (name -> source)."""
    original = reference.forward

    def recording(a, bs, operands, epilogue, b_transposed):
        case = gemm_kernels._Case(a, bs, operands, epilogue, b_transposed)
        why = cutlass_kernels.layout_unsupported(case.ep, case.a2, case.bs, case.ops, b_transposed, case.bcast)
        cfgs = gemm_kernels.cutlass_configs(case.M)
        if not cfgs or why:
            stats[why or "decode step"] = stats.get(why or "decode step", 0) + 1
        else:
            jobs.update(case.cutlass_source(cfg) for cfg in cfgs)
        return original(a, bs, operands, epilogue, b_transposed)

    reference.forward = recording


def run_transformers(modes):
    from torch_xaccel.bench.model import transformers_xlstm_without_package

    modeling = transformers_xlstm_without_package()
    tokens = torch.randint(0, 1024, (1, 320))
    for mode in modes:
        cfg = modeling.xLSTMConfig(vocab_size=1024, chunk_size=64, mode="train" if mode == "train" else "inference",
                                   use_cache=False, hidden_size=4096, num_heads=8, num_blocks=1)
        torch.manual_seed(0)
        model = modeling.xLSTMForCausalLM(cfg).to(torch.bfloat16)
        torch._dynamo.reset()
        fn = torch.compile(model, backend="xaccel")
        if mode == "train":
            logits = fn(tokens).logits
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
        else:
            with torch.inference_mode():
                fn(tokens, use_cache=True)


def run_model(modes):
    from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

    from torch_xaccel.bench.model import NATIVE_KERNELS

    tokens = torch.randint(0, 1024, (1, 320))  # M = 320: above the decode-sized rows
    for mode in modes:
        cfg = xLSTMLargeConfig(vocab_size=1024, chunk_size=64, mode="train" if mode == "train" else "inference",
                               return_last_states=mode == "train", embedding_dim=4096, num_heads=8, num_blocks=1,
                               **NATIVE_KERNELS)
        torch.manual_seed(0)
        model = xLSTMLarge(cfg).to(torch.bfloat16)
        torch._dynamo.reset()
        fn = torch.compile(model, backend="xaccel")
        if mode == "train":
            logits = fn(tokens)[0]
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
        else:
            with torch.inference_mode():
                fn(tokens)


def main():
    # as on an sm_90 GPU with CUTLASS (lowering/gemm_epilogue/backward.py)
    os.environ.setdefault("XACCEL_BACKWARD_FUSION", "1")
    args = sys.argv[1:]
    modes = [a for a in args if a != "transformers"] or ["prefill", "train"]
    jobs, stats = {}, {}
    record_cases(jobs, stats)
    (run_transformers if "transformers" in args else run_model)(modes)
    print(f"{len(jobs)} CUTLASS kernels for {modes}; calls CUTLASS cannot serve: {stats or 'none'}", flush=True)
    cutlass_kernels.build_all(list(jobs.items()), "prebuild")
    failed = [n for n, s in jobs.items() if cutlass_kernels.state(n, s) != "built"]
    print(f"built {len(jobs) - len(failed)}; not built: {failed or 'none'}")


if __name__ == "__main__":
    main()
