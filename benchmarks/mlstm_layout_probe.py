"""Reading transposed projections in place or copying them first: the mLSTM op on [B, S, H, D]
tensors viewed as [B, H, S, D] (what a model hands over), with triton_mlstm.READ_STRIDED on and
off, against contiguous inputs; per-kernel profile of both; then the 7B-width xLSTMLarge (rest
by Inductor) train step and prefill both ways. --gradients: only that train step with the
backward's dq, dk, dv in their inputs' layout (ops/mlstm.GRADIENTS_IN_INPUT_LAYOUT) and contiguous.
Run on the GPU machine:

    python benchmarks/mlstm_layout_probe.py [--no-model] [--gradients]
"""
import argparse
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).parent))
from torch_xaccel.codegen import triton_mlstm as tm  # noqa: E402

SHAPES = [(8, 16, 8192, 128, 128), (8, 8, 4096, 256, 512)]


def op_rows(shape):
    B, H, S, DK, DV = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *d: torch.randn(B, S, H, *d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    raw = [mk(DK), mk(DK), mk(DV), mk(), 3.0 + mk()]
    layouts = {"contiguous": [t.transpose(1, 2).contiguous() for t in raw], "transposed view": [t.transpose(1, 2) for t in raw]}
    for name, base in layouts.items():
        x = [t.detach().requires_grad_() for t in base]
        dh = torch.randn(B, H, S, DV, device="cuda", dtype=torch.bfloat16, generator=g)

        def fwd():
            with torch.no_grad():
                return torch.ops.xaccel.mlstm(*x, None, None, None, 1e-6, 64)[0]

        def fwd_bwd():
            torch.ops.xaccel.mlstm(*x, None, None, None, 1e-6, 64)[0].backward(dh)
        for strided in ((True, False) if name != "contiguous" else (True,)):
            tm.READ_STRIDED = strided
            f = triton.testing.do_bench(fwd, warmup=10, rep=50)
            fb = triton.testing.do_bench(fwd_bwd, warmup=5, rep=30, grad_to_none=x)
            print(f"{shape} {name:16s} {'read in place' if strided else 'copied first':14s} fwd {f:.3f} ms  "
                  f"fwd+bwd (.grad reset) {fb:.3f} ms", flush=True)
            if name != "contiguous":
                profile(shape, f"{name}, {'in place' if strided else 'copied'}", fwd_bwd)
    tm.READ_STRIDED = True


def profile(shape, label, fn):
    from mlstm_sweep import kernel_times

    for ms, n, key in kernel_times(fn)[1][:10]:
        print(f"{shape} {label}:   {ms:7.3f} ms x{n:<3d} {key[:80]}", flush=True)


def model_rows(gradients=False):
    """The model both ways; gradients: the train step with dq, dk, dv in their inputs' layout
    (True) or contiguous (False) instead of READ_STRIDED."""
    import os

    from torch_xaccel.ops import mlstm

    os.environ["XACCEL_FALLBACK"] = "inductor"
    import torch._dynamo
    from model_profile import model, step

    torch._dynamo.config.cache_size_limit = 64
    ids = torch.randint(0, 50304, (4, 2048), device="cuda")
    for mode in ("train",) if gradients else ("train", "prefill"):
        for on in (True, False, True):
            if gradients:
                mlstm.GRADIENTS_IN_INPUT_LAYOUT = on
            else:
                tm.READ_STRIDED = on
            torch._dynamo.reset()
            m = model("inference" if mode == "prefill" else "train")
            fn = torch.compile(m, backend="xaccel")
            ms = triton.testing.do_bench(lambda: step(mode, m, fn, ids), warmup=3, rep=20)
            what = ("gradients in the inputs' layout" if on else "contiguous gradients") if gradients else \
                ("inputs read in place" if on else "inputs copied first")
            print(f"xLSTMLarge 7B widths B4 S2048, rest by Inductor, {mode}: {what}: {ms:.3f} ms", flush=True)
    tm.READ_STRIDED = mlstm.GRADIENTS_IN_INPUT_LAYOUT = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--gradients", action="store_true", help="only the train step, gradient layouts A/B")
    args = ap.parse_args()
    import torch_xaccel  # noqa: F401 - registers the op

    if args.gradients:
        model_rows(gradients=True)
        return
    for shape in SHAPES:
        op_rows(shape)
    if not args.no_model:
        model_rows()


if __name__ == "__main__":
    main()
