"""Does an exported model run in a stock onnxruntime (CPU) within 2x of PyTorch eager, and does its
file stay the same size whatever the sequence length?

For the demo model (B4 x S32 tokens) and a small xLSTMLarge (native kernels, embedding 128, 2
blocks, B1 x S512): export with torch_xaccel.onnx (one xaccel node per fused region, function
bodies attached), then the median of repeated calls of onnxruntime's CPUExecutionProvider session
and of the eager model under torch.no_grad, same inputs, same process, fp32. The file size is also
printed for a second sequence length and a wider model. Run on any CPU machine:

    python benchmarks/onnx_cpu.py [--threads N] [--reps N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import torch


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _xlstm_large(embedding=128, blocks=2):
    from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

    cfg = xLSTMLargeConfig(embedding_dim=embedding, num_heads=2, num_blocks=blocks, vocab_size=97, chunk_size=64,
                           mode="inference", chunkwise_kernel="chunkwise--native_autograd",
                           sequence_kernel="native_sequence__native", step_kernel="native")
    torch.manual_seed(0)
    return xLSTMLarge(cfg).eval()


def _row(name, model, tokens, reps, directory):
    import onnxruntime

    from torch_xaccel import onnx as xonnx

    path = os.path.join(directory, f"{name}.onnx")
    t0 = time.perf_counter()
    res = xonnx.export(model, (tokens,), path, report=False)
    export_s = time.perf_counter() - t0
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: tokens.numpy()}
    with torch.no_grad():
        eager = _median_ms(lambda: model(tokens), reps)
        want = model(tokens)
    want = want[0] if isinstance(want, tuple) else want
    ort = _median_ms(lambda: session.run(None, feed), reps)
    got = torch.from_numpy(session.run(None, feed)[0])
    err = ((got - want).norm() / want.norm()).item()
    print(f"| {name} | {list(tokens.shape)} | {eager:.2f} | {ort:.2f} | {ort / eager:.2f} | "
          f"{os.path.getsize(path) / 1e6:.2f} | {export_s:.1f} | {res.nodes()} | {err:.1e} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=0, help="torch and onnxruntime intra-op threads (0: default)")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    from torch_xaccel.demo import DemoModel

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| model | tokens | eager ms | onnxruntime ms | ratio | file MB | export s | xaccel nodes | rel err |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        demo = DemoModel().eval()
        _row("demo", demo, torch.randint(0, 101, (4, 32)), args.reps, d)
        _row("demo_S128", demo, torch.randint(0, 101, (4, 128)), args.reps, d)
        large = _xlstm_large()
        _row("xlstm_large_S512", large, torch.randint(0, 97, (1, 512)), args.reps, d)
        _row("xlstm_large_S128", large, torch.randint(0, 97, (1, 128)), args.reps, d)
        _row("xlstm_large_E256_S512", _xlstm_large(256), torch.randint(0, 97, (1, 512)), args.reps, d)


if __name__ == "__main__":
    main()
