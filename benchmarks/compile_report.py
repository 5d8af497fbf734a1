"""Do the generated kernels fit sm_90 (registers, spills, shared memory), checked without a GPU?

Compile generated kernels for sm_90 WITHOUT a GPU and report registers, spills and shared memory.

    python benchmarks/compile_report.py [--mlstm-shapes 128x128,512x512] [--all-candidates] [--no-gemm] [--dtype fp32]

Uses the local Triton (CI's version, not necessarily the GPU machine's) and the ptxas it bundles
(`ptxas-blackwell`, which accepts the PTX version Triton emits). Spills and shared-memory overruns
show here for free; timings still need the GPU.
"""
import os
import re
import subprocess
import tempfile

os.environ.setdefault("XACCEL_CACHE_DIR", os.path.join(tempfile.gettempdir(), "xaccel-compile-report"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from torch_xaccel.codegen import cache  # noqa: E402
from torch_xaccel.codegen.gemm_epilogue.render import render_triton  # noqa: E402
from torch_xaccel.codegen.limits import SHARED_LIMIT  # noqa: E402
from torch_xaccel.codegen.mlstm import configs as mlstm_configs, triton_kernels as mlstm_triton  # noqa: E402
from torch_xaccel.ops.gemm_epilogue.epilogue_ir import Epilogue  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")


def report(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int) -> str:
    sig = {a: ("constexpr" if a in constexprs else types[a]) for a in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=TARGET,
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
        fh.write(k.asm["ptx"])
    proc = subprocess.run([PTXAS, "-arch=sm_90a", "-v", fh.name, "-o", os.devnull], capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    fits = "" if k.metadata.shared <= SHARED_LIMIT else "  (over the 227 KiB shared-memory limit)"
    return (f"regs {regs[0] if regs else '?'}  spill stores {spills[0] if spills else '?'} B  "
            f"shared {k.metadata.shared} B{fits}")


def _load(name, src):
    return getattr(cache.load_source(name, src), name)


def gemm_kernels():
    ep = Epilogue(({"op": "acc", "index": 0}, {"op": "load", "operand": 0, "bcast": "row"}, {"op": "add", "in": [0, 1]},
                   {"op": "gelu_tanh", "in": [2]}, {"op": "load", "operand": 1, "bcast": "full"},
                   {"op": "add", "in": [3, 4]}), (5,))
    for variant in ("tma", "tma2"):
        fn = _load(*render_triton(ep, 2, "ieee", variant, True))
        types = {a: ("tensordesc<bf16[128, 64]>" if a == "a_desc"
                     else "tensordesc<bf16[256, 64]>" if a.endswith("_desc")
                     else "*bf16" if a.endswith("_ptr") else "i32") for a in fn.arg_names}
        cons = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, NUM_SMS=132, FLATTEN=True)
        print(f"gemm_epilogue {variant:4s} 128x256x64 8 warps 3 stages: {report(fn, types, cons, 8, 3)}")


def mlstm_kernels(shapes=((128, 128), (256, 512)), all_candidates: bool = False, dtype: torch.dtype = torch.bfloat16):
    """Every mLSTM kernel at the default configs (or, all_candidates, at every tuning candidate,
    each distinct kernel config once) for the given (DK, DV) head shapes and input dtype."""
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]

    def types_for(fn):
        return {a: (ptr if a in ("q_ptr", "k_ptr", "v_ptr", "h_ptr", "Cs_ptr", "dCs_ptr", "dh_ptr", "dq_ptr",
                                     "dk_ptr", "dv_ptr", "dS_ptr")
                    else "i32" if a in ("S", "NC", "NT", "NKT", "H") or a[-3:] in ("_sb", "_sh", "_ss")
                    else "fp32" if a in ("scale", "eps") else "*i8" if a == "start_ptr" else "*fp32")
                for a in fn.arg_names}

    seen = set()
    for DK, DV in shapes:
        size = dtype.itemsize
        fwd = mlstm_configs.forward_candidates(DK, DV, size)
        if all_candidates:  # and the sliced kernel's neighbours that mlstm_sweep.py --sliced times
            fwd = mlstm_configs.unique(fwd + mlstm_configs.sliced_sweep_configs(DK, DV))
        phases = (("fwd", fwd), ("bwd", mlstm_configs.backward_candidates(DK, DV, size)))
        for phase, cands in phases:
            for cfg in cands if all_candidates else cands[:1]:
                scan = mlstm_configs.scan_warps(cfg)
                kernels = [("mlstm_chunk_gates.py.jinja", {}, 4),
                           ("mlstm_chunk_states.py.jinja", dict(BK=cfg["BK"], BV=cfg["BVS"]), scan)]
                fwd_tiles = dict(BV=cfg["BV"], **({"BKQ": cfg["BKQ"]} if cfg.get("BKQ") else {}))
                kernels += ([("mlstm_fwd.py.jinja", fwd_tiles, cfg["warps"])] if phase == "fwd" else
                            [("mlstm_bwd_rows.py.jinja", dict(BV=cfg["BV"]), cfg["warps"]),
                             ("mlstm_bwd_states.py.jinja", dict(BK=cfg["BK"], BV=cfg["BVS"]), scan),
                             ("mlstm_bwd_ds.py.jinja" if cfg.get("DKS") else "mlstm_bwd.py.jinja",
                              dict(BV=cfg["BV"], **{k: cfg[k] for k in ("DVS", "DKS") if cfg.get(k)}), cfg["warps"])])
                if phase == "bwd" and cfg.get("DVS"):
                    kernels.append(("mlstm_bwd_dv.py.jinja", dict(BV=cfg["DVS"]), cfg["warps"]))
                if phase == "bwd" and cfg.get("DKS"):
                    kernels.append(("mlstm_bwd_dqdk.py.jinja", dict(BV=cfg["BV"], BK=cfg["DKS"]), cfg["warps"]))
                if phase == "bwd":  # the fused backward tail (no tile config: once per head shape)
                    kernels.append(("mlstm_bwd_route.py.jinja", dict(BLOCK=1024, NTP=4), 4))
                for template, tiles, warps in kernels:
                    key = (template, DK, DV, cfg["L"], tuple(sorted(tiles.items())), warps, cfg["stages"],
                           cfg.get("LF"))
                    if key in seen:
                        continue
                    seen.add(key)
                    extra = (dict(has_state=False, loads_first=bool(cfg.get("LF")))
                             if template == "mlstm_chunk_states.py.jinja" else
                             dict(k_loop="BKQ" in tiles, save_rows=True) if template == "mlstm_fwd.py.jinja" else
                             dict(split_dv="DVS" in tiles)
                             if template in ("mlstm_bwd.py.jinja", "mlstm_bwd_ds.py.jinja") else
                             dict(saved_rows=True) if template == "mlstm_bwd_rows.py.jinja" else
                             dict(final_grads=False) if template == "mlstm_bwd_states.py.jinja" else
                             dict(has_state=False) if template == "mlstm_bwd_route.py.jinja" else {})
                    fn = _load(*mlstm_triton._render(template, dtype, False, **extra))
                    cons = dict(DK=DK, DV=DV, DKR=DK, DVR=DV, L=cfg["L"],
                                **{k: v for k, v in tiles.items() if k not in ("DVS", "DKS")})
                    cons = {k: v for k, v in cons.items() if k in fn.arg_names}  # the gates kernel takes L alone
                    print(f"{template.split('.')[0]:20s} DK{DK} DV{DV} {cons} {warps} warps {cfg['stages']} stages: "
                          f"{report(fn, types_for(fn), cons, warps, cfg['stages'])}", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--mlstm-shapes", default="128x128,256x512", help="DKxDV head shapes, comma-separated")
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--all-candidates", action="store_true", help="every mLSTM tuning candidate, not only the defaults")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="mLSTM input dtype")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target sm_90 (ptxas {os.path.basename(PTXAS)})")
    if not args.no_gemm:
        gemm_kernels()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    mlstm_kernels([tuple(int(x) for x in s.split("x")) for s in args.mlstm_shapes.split(",")], args.all_candidates,
                  dtype)
