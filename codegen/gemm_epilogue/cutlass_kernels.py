"""Generated CUTLASS kernels for xaccel::gemm_epilogue: the epilogue IR rendered into a CUTLASS 3
sm90 GEMM's epilogue visitor tree (EVT), built with nvcc into a shared library, launched through
ctypes.

Why: the generated Triton mainloop runs behind cuBLAS on the same GEMM (figures in
docs/benchmarks.md); CUTLASS's warp-specialized wgmma mainloop is cuBLAS's own kind. The tuner
times these next to the Triton configs and the ATen composition (triton_kernels.py), so a CUTLASS
kernel runs only where tuning timed it fastest. The libraries' C entry points and status codes are
csrc/gemm_epilogue/cutlass_entry.cuh.

Covered: one GEMM, any number of outputs (the first through CUTLASS's D, the others through
auxiliary stores), fp16/bf16, B as an nn.Linear weight (N x K) or K x N, operands
broadcast by row (a bias) or column, at most one full [M, N] operand (read as CUTLASS's C), and
0-d scalars; 16-byte aligned rows (K and N multiples of 8). Everything else is left to Triton.
Kernels target sm_90a and run only on compute capability 9.0.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import torch

from torch_xaccel import config
from torch_xaccel.ops.gemm_epilogue.epilogue_ir import Epilogue

from .. import cache
from ..render import CSRC
from ..tuning import Progress
from .render import TEMPLATES, compute_expr

_ELEMENT = {torch.bfloat16: "cutlass::bfloat16_t", torch.float16: "cutlass::half_t", torch.float32: "float"}

# (variant, BLOCK_M, BLOCK_N, BLOCK_K, cluster_m, cluster_n, swizzle, raster); raster 0: CUTLASS's
# heuristic, 1: along M, 2: along N. Swizzle and raster are launch arguments: one build serves them.
#   cutlass: the cooperative schedule (two consumer warp groups share a tile);
#   cutlass_pp: ping-pong (each consumer warp group owns a tile: one's epilogue runs while the
#   other's mainloop does, which hides a heavy chain).
LARGE = [("cutlass", 128, 256, 64, 2, 1, 8, 0), ("cutlass", 128, 256, 64, 2, 1, 1, 0),
         ("cutlass", 256, 128, 64, 1, 2, 8, 0), ("cutlass_pp", 128, 128, 64, 2, 1, 8, 0),
         ("cutlass_pp", 128, 128, 64, 1, 2, 8, 0)]
# Decode-sized M (64 < M <= 256): one or two rows of tiles, so the time is reading B once. A 1x2
# cluster multicasts x's tile to both CTAs; a 2x1 cluster of 64-row tiles shares the weight tile.
# Not here: 64x128x128 ping-pong, 128x64x128 and a stream-K schedule, which lost to these three at
# M128 (measured: docs/benchmarks.md's git history).
SMALL = [("cutlass", 128, 128, 64, 1, 2, 1, 0), ("cutlass", 128, 128, 128, 1, 2, 1, 0),
         ("cutlass_pp", 64, 256, 64, 2, 1, 1, 0)]
SMALL_MIN_M = 64  # at most this many rows (decode steps' M1/M8 GEMMs): no CUTLASS candidates
VARIANTS = ("cutlass", "cutlass_pp")


@functools.lru_cache(maxsize=None)
def toolchain() -> tuple[str, Path] | str:
    """(nvcc path, CUTLASS source root) or why CUTLASS kernels cannot be built here."""
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if nvcc is None:
        return "nvcc not found on PATH"
    try:
        import cutlass_library
    except ImportError:
        return "the nvidia-cutlass package (CUTLASS headers) is not installed"
    root = Path(cutlass_library.source_path)
    if not (root / "include" / "cutlass" / "cutlass.h").exists():
        return f"CUTLASS headers not found under {root}"
    return nvcc, root


def available() -> bool:
    """An sm_90 GPU is present and nvcc and the CUTLASS headers are installed."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    return not isinstance(toolchain(), str)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def unsupported(ep: Epilogue, a2: torch.Tensor, bs, ops, b_transposed: bool, bcast: dict) -> str | None:
    """Why this call cannot run as a CUTLASS kernel (None: it can). a2 is a as [M, K]; ops are the
    operands reshaped as triton_kernels._Case does (full [M, N], row [N], col [M], scalar [1])."""
    if a2.device.type != "cuda" or torch.cuda.get_device_capability(a2.device) != (9, 0):
        return "CUTLASS kernels are built for sm_90a (H100/H200)"
    return layout_unsupported(ep, a2, bs, ops, b_transposed, bcast)


def layout_unsupported(ep: Epilogue, a2: torch.Tensor, bs, ops, b_transposed: bool, bcast: dict) -> str | None:
    """unsupported() without the device check: whether the call's dtypes, sizes and strides fit
    (benchmarks/cutlass_prebuild.py asks it on a machine without the GPU)."""
    if a2.dtype not in (torch.float16, torch.bfloat16):
        return f"{a2.dtype} (fp16/bf16 only)"
    if len(bs) != 1:
        return "dual GEMMs run as Triton kernels"
    if len(set(ep.outputs)) != len(ep.outputs):
        return "an output listed twice"
    b = bs[0]
    M, K = a2.shape
    N = b.shape[0] if b_transposed else b.shape[1]
    if K % 8 or N % 8 or a2.stride(1) != 1 or a2.stride(0) % 8 or b.stride(1) != 1 or b.stride(0) % 8:
        return "rows not 16-byte aligned (K and N must be multiples of 8, inner strides 1)"
    if not (_aligned(a2) and _aligned(b)) or max(M, N, K) >= 2 ** 31:
        return "unaligned pointers or sizes beyond int32"
    fulls = [j for j, kind in bcast.items() if kind == "full"]
    if len(fulls) > 1:
        return "more than one full [M, N] operand"
    for j, kind in bcast.items():
        t = ops[j]
        if t.dtype not in _ELEMENT:
            return f"operand {j} of dtype {t.dtype}"
        if kind == "full" and (t.dtype != a2.dtype or t.stride(1) != 1 or t.stride(0) % 8 or not _aligned(t)):
            return "the full operand is not a 16-byte aligned row-major matrix of the input dtype"
        if kind in ("row", "col") and (t.stride(0) != 1 or not _aligned(t)):
            return f"operand {j} ({kind}) is not a contiguous, 16-byte aligned vector"
        if kind == "col" and M % 8:  # CUTLASS reads a column vector in vectors of up to 8, checking only the first row
            return "a column operand needs M to be a multiple of 8"
    return None


def _lines(ep: Epilogue, need: set[int], preset: dict[int, str]) -> list[str]:
    """C++ for the nodes in `need`, in order; a load reads its operand's parameter op<j>, a node in
    `preset` (an extra output's value) that parameter's value."""
    lines = []
    for i, n in enumerate(ep.nodes):
        op = n["op"]
        if i not in need:
            continue
        if i in preset:
            expr = preset[i]
        elif op == "acc":
            expr = "acc"
        elif op == "load":
            expr = f"op{n['operand']}"
        elif op == "const":
            expr = f"{float(n['value'])!r}f".replace("inff", "INFINITY")
        else:
            temps, expr = compute_expr(i, n, "cutlass")
            lines += [t + ";" for t in temps]
        lines.append(f"const float v{i} = {expr};")
    return lines


def _needed(ep: Epilogue, node: int, stop: set[int]) -> set[int]:
    """`node` and the nodes it is computed from, not looking past the nodes in `stop`."""
    need, todo = set(), [node]
    while todo:
        i = todo.pop()
        if i in need:
            continue
        need.add(i)
        if i not in stop:
            todo += ep.nodes[i].get("in", [])
    return need


def _children(ep: Epilogue, need: set[int], op_dtypes: list[torch.dtype]) -> list[tuple[int, str, str]]:
    """(operand, EVT child type, its arguments) for each operand the nodes in `need` load, in the
    order the chain first reads them."""
    fusion, out, seen = "cutlass::epilogue::fusion", [], set()
    for i, n in enumerate(ep.nodes):
        j = n.get("operand")
        if i not in need or n["op"] != "load" or j in seen:
            continue
        seen.add(j)
        el = _ELEMENT[op_dtypes[j]]
        ptr = f"static_cast<const {el}*>(ops[{j}])"
        if n["bcast"] == "row":
            out.append((j, f"{fusion}::Sm90RowBroadcast<0, TileShape, {el}, float>", f"{{{ptr}}}"))
        elif n["bcast"] == "col":
            out.append((j, f"{fusion}::Sm90ColBroadcast<0, TileShape, {el}, float>", f"{{{ptr}}}"))
        elif n["bcast"] == "scalar":
            out.append((j, f"{fusion}::Sm90ScalarBroadcast<{el}>", f"{{{{}}, {{{ptr}}}, {{}}}}"))
        else:
            out.append((j, f"{fusion}::Sm90SrcFetch<ElementC>", "{}"))
    return out


def render(ep: Epilogue, dtype: torch.dtype, op_dtypes: list[torch.dtype], bcast: dict, b_transposed: bool,
           cfg: tuple) -> tuple[str, str]:
    """(kernel name, C++ source) for one epilogue, dtype, B layout and tile/cluster/schedule.

    The EVT: the final output's chain (ChainFn0) reads the accumulator, its operands and one
    subtree per extra output k: that output's own chain (ChainFn<k>, on the operands it needs)
    under an Sm90AuxStore that writes it (rounded) to outs[k] and passes its fp32 value on, so
    the final chain reads it instead of computing it again."""
    variant, bm, bn, bk, cm, cn, _, _ = cfg
    el = _ELEMENT[dtype]
    extra = {o: k for k, o in enumerate(ep.outputs) if k > 0}
    chains, subtrees = [None], []
    for o, k in extra.items():
        need = _needed(ep, o, set())
        kids = _children(ep, need, op_dtypes)
        chains.append(dict(what=f"output {k} (IR node {o})", params=["acc", *[f"op{j}" for j, _, _ in kids]],
                           lines=_lines(ep, need, {}),
                           result=f"v{o}"))
        compute = (f"Sm90EVT<Sm90Compute<ChainFn{k}, float, float, kRound>, "
                   f"Sm90AccFetch{''.join(', ' + t for _, t, _ in kids)}>")
        subtrees.append((f"out{k}",
                         f"Sm90EVT<Sm90AuxStore<0, void, {el}, kRound, cutlass::layout::RowMajor, void, void>, "
                         f"{compute}>",
                         f"{{{{{{}}{''.join(', ' + a for _, _, a in kids)}, {{}}}}, "
                         f"{{static_cast<{el}*>(outs[{k}]), row_major<RowStride>(ldd)}}}}"))
    final = ep.outputs[0]
    need = _needed(ep, final, set(extra) - {final})
    kids = _children(ep, need, op_dtypes)
    preset = {o: f"out{k}" for o, k in extra.items() if o in need and o != final}
    chains[0] = dict(what="the op's first output",
                     params=["acc", *[f"op{j}" for j, _, _ in kids], *[p for p, _, _ in subtrees]],
                     lines=_lines(ep, need, preset), result=f"v{final}")
    fusion_type = (f"Sm90EVT<Sm90Compute<ChainFn0, ElementOut, float, kRound>, Sm90AccFetch"
                   f"{''.join(', ' + t for _, t, _ in kids)}{''.join(', ' + t for _, t, _ in subtrees)}>")
    fusion_args = "{" + ", ".join(["{}", *[a for _, _, a in kids], *[a for _, _, a in subtrees], "{}"]) + "}"
    full = next((j for j, kind in bcast.items() if kind == "full"), None)
    text = f"{ep.to_json()}|{dtype}|{[str(d) for d in op_dtypes]}|{b_transposed}|{cfg[:6]}"
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    name = f"gemm_epilogue_1x_{variant}_{bm}x{bn}x{bk}_c{cm}x{cn}_{digest}"
    src = TEMPLATES.render(
        "gemm_epilogue_cutlass.cu.jinja", kernel_name=name, description=ep.describe(), epilogue_json=ep.to_json(),
        element=el,
        element_c=_ELEMENT[op_dtypes[full]] if full is not None else "void", full_operand=full, chains=chains,
        fusion_type=fusion_type, fusion_args=fusion_args, bm=bm, bn=bn, bk=bk, cm=cm, cn=cn,
        schedule="cooperative" if variant == "cutlass" else "pingpong", b_transposed=b_transposed,
        n_operands_or_one=max(1, len(op_dtypes)), n_outputs=len(ep.outputs))
    return name, src


# ---- build: nvcc -> <cache>/cutlass/<key>.so, once per source and toolchain -----------------------
# A build is one shell job (nvcc, then a rename into place), started detached: it finishes and
# lands in the cache even if this process exits first, so a background build is never wasted.
# <key>.building marks a build in progress (any process); <key>.failed keeps nvcc's output.

class CutlassBuildError(RuntimeError):
    """nvcc failed on a generated kernel, or cannot run here; the message ends with its output."""


BUILD_TIMEOUT_S = 900  # a .building marker older than this belongs to a build that died


@functools.lru_cache(maxsize=None)
def _toolchain_tag() -> str:
    tools = toolchain()
    if isinstance(tools, str):
        return "none"
    import cutlass_library

    out = subprocess.run([tools[0], "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    return f"{out.splitlines()[-1] if out else '?'}|{getattr(cutlass_library, '__version__', '?')}"


def _paths(name: str, src: str) -> dict[str, Path]:
    """The cache files of one build, keyed by the source, the headers it includes (the family's
    digest covers csrc/gemm_epilogue) and the toolchain."""
    key = f"{name}_{hashlib.sha256(f'{src}|{TEMPLATES.digest}|{_toolchain_tag()}'.encode()).hexdigest()[:10]}"
    folder = cache.root() / "cutlass"
    return {k: folder / f"{key}{ext}" for k, ext in
            (("lib", ".so"), ("failed", ".failed"), ("building", ".building"), ("log", ".log"), ("src", ".cu"))}


def state(name: str, src: str) -> str:
    """"built", "failed", "building" (by some process, recently) or "absent"."""
    p = _paths(name, src)
    if p["lib"].exists():
        return "built"
    if p["failed"].exists():
        return "failed"
    try:
        if time.time() - p["building"].stat().st_mtime < BUILD_TIMEOUT_S:
            return "building"
    except OSError:
        pass
    return "absent"


def max_builds() -> int:
    """How many nvcc builds may run at once in one cache (XACCEL_COMPILE_THREADS, at most the CPU
    count): a model with ten epilogues would otherwise start forty, each taking a core and a GB or
    two of memory. Counted from the .building markers, so it holds across processes (loosely: two
    processes starting at the same instant may both take the last slot)."""
    return max(1, min(config.current().compile_threads, os.cpu_count() or 1))


def running_builds() -> int:
    now, n = time.time(), 0
    for marker in (cache.root() / "cutlass").glob("*.building"):
        try:
            n += now - marker.stat().st_mtime < BUILD_TIMEOUT_S
        except OSError:  # finished meanwhile
            pass
    return n


def start_build(name: str, src: str) -> subprocess.Popen | None:
    """Start building `src` unless it is built, failed or being built, or max_builds() builds are
    running (it stays "absent": callers try again later); returns the job or None."""
    tools = toolchain()
    if isinstance(tools, str):
        raise CutlassBuildError(tools)
    if state(name, src) != "absent":
        return None
    nvcc, root = tools
    p = _paths(name, src)
    p["lib"].parent.mkdir(parents=True, exist_ok=True)
    if running_builds() >= max_builds():
        return None
    try:
        fd = os.open(p["building"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # a stale marker (state said so) or another process just now
        if state(name, src) != "absent":
            return None
        p["building"].unlink(missing_ok=True)
        return start_build(name, src)
    os.close(fd)
    cache.atomic_write(p["src"], src)
    tmp = f"{p['lib']}.{os.getpid()}.tmp"
    cmd = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a",
           "-Xcompiler=-fPIC", "-shared", f"-I{root / 'include'}", f"-I{root / 'tools' / 'util' / 'include'}",
           f"-I{CSRC / 'gemm_epilogue'}",
           str(p["src"]), "-o", tmp]
    script = (f'{shlex.join(cmd)} > {shlex.quote(str(p["log"]))} 2>&1'
              f' && mv -f {shlex.quote(tmp)} {shlex.quote(str(p["lib"]))}'
              f' || {{ mv -f {shlex.quote(str(p["log"]))} {shlex.quote(str(p["failed"]))};'
              f' rm -f {shlex.quote(tmp)}; }};'
              f' rm -f {shlex.quote(str(p["log"]))} {shlex.quote(str(p["building"]))}')
    try:
        return subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:  # no shell to run it: drop the marker, or waiters would wait out its 15 minutes
        p["building"].unlink(missing_ok=True)
        raise CutlassBuildError(f"could not start nvcc for {name}: {e}") from e


def wait_built(name: str, src: str, timeout_s: float = BUILD_TIMEOUT_S) -> None:
    """Block until `src` is built (by this process or another); raise CutlassBuildError if it failed."""
    t0 = time.time()
    st = state(name, src)
    while st not in ("built", "failed") and time.time() - t0 < timeout_s:
        job = start_build(name, src) if st == "absent" else None
        if job is not None:
            job.wait(max(1.0, timeout_s - (time.time() - t0)))
        else:  # building elsewhere, or waiting for a free build slot
            time.sleep(0.5)
        st = state(name, src)
    if st == "failed":
        log = _paths(name, src)["failed"].read_text()
        raise CutlassBuildError(f"nvcc failed on {name}: {log.strip()[-600:]}")
    if st != "built":
        raise CutlassBuildError(f"{name}: the build did not finish within {timeout_s:.0f} s")


_LIBS: dict[str, ctypes.CDLL] = {}


def load(name: str, src: str) -> ctypes.CDLL:
    """The built library for `src`, building it first if needed (blocking). Memoised by name (which
    hashes everything that shapes the source): this runs on every call of a CUTLASS kernel."""
    if name in _LIBS:
        return _LIBS[name]
    path = _paths(name, src)["lib"]
    wait_built(name, src)
    handle = ctypes.CDLL(str(path))
    handle.xaccel_workspace_size.restype = ctypes.c_size_t
    handle.xaccel_workspace_size.argtypes = [ctypes.c_int] * 4
    handle.xaccel_run.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    handle.xaccel_run.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, *[ctypes.c_int] * 6, ptr, ctypes.c_size_t,
                                  ptr]
    handle.xaccel_status_message.restype = ctypes.c_char_p
    handle.xaccel_status_message.argtypes = [ctypes.c_int]
    _LIBS[name] = handle
    return handle


def build_all(jobs: list[tuple[str, str]], label: str) -> None:
    """Build several kernels, max_builds() nvcc processes at a time, with a progress line; errors
    are raised again, with nvcc's output, when each is loaded for timing."""
    pending = list(dict.fromkeys((n, s) for n, s in jobs if state(n, s) not in ("built", "failed")))
    if not pending:
        return
    # an nvcc build is slow: the bar shows at once
    progress = Progress(f"tuning {label}: building {len(pending)} CUTLASS kernels (nvcc, once)", len(pending),
                        show_after_s=0.0)
    running: dict = {}
    total, t0, shown = len(pending), time.time(), -1
    while (pending or running) and time.time() - t0 < BUILD_TIMEOUT_S:
        for item in list(pending):
            st = state(*item)
            if st in ("built", "failed"):  # by another process
                pending.remove(item)
            elif st == "absent":
                job = start_build(*item)
                if job is not None:
                    running[item] = job
                    pending.remove(item)
        for item, job in list(running.items()):
            if job.poll() is not None:
                del running[item]
        if total - len(pending) - len(running) != shown:
            shown = total - len(pending) - len(running)
            progress.step(shown)
        if pending or running:
            time.sleep(0.5)
    progress.close()


# ---- launch --------------------------------------------------------------------------------------

_WORKSPACES: dict = {}


def launch(lib: ctypes.CDLL, cfg: tuple, a2, b, ops: list, outs: list, sm_count: int) -> None:
    """Run the built kernel on the current stream; raises on any failure (the runtime then reports
    it and runs the ATen composition)."""
    M, K = a2.shape
    N = outs[0].shape[1]
    wbytes = lib.xaccel_workspace_size(M, N, K, sm_count)
    work = None
    if wbytes:
        work = _WORKSPACES.get(a2.device)
        if work is None or work.numel() < wbytes:
            work = _WORKSPACES[a2.device] = torch.empty(wbytes, dtype=torch.uint8, device=a2.device)
    n = max(1, len(ops))
    ptrs = (ctypes.c_void_p * n)(*[t.data_ptr() for t in ops])
    lds = (ctypes.c_int64 * n)(*[t.stride(0) if t.dim() == 2 else 0 for t in ops])
    out_ptrs = (ctypes.c_void_p * len(outs))(*[o.data_ptr() for o in outs])
    stream = torch.cuda.current_stream(a2.device).cuda_stream
    status = lib.xaccel_run(a2.data_ptr(), a2.stride(0), b.data_ptr(), b.stride(0), out_ptrs, outs[0].stride(0),
                            ptrs, lds, M, N, K, sm_count, cfg[6], cfg[7],
                            work.data_ptr() if work is not None else None, wbytes, stream)
    if status:
        message = lib.xaccel_status_message(status).decode()
        raise RuntimeError(f"CUTLASS kernel: {message} (status {status}, M{M} N{N} K{K})")
