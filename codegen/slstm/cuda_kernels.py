"""The sLSTM forward as one persistent CUDA kernel on Hopper thread-block clusters: rendered from
templates/slstm_forward.cu.jinja (device helpers in csrc/slstm/), built with NVRTC through
cuda-python's cuda.core, cached as a cubin under XACCEL_CACHE_DIR/slstm/, launched on torch's
current stream. Cases it does not cover return NotImplemented (the runtime then runs the next
provider or the reference); a failed build or launch raises, and the runtime reports it and falls
back."""
from __future__ import annotations

import functools
import hashlib
import math
from pathlib import Path

import torch

from torch_xaccel import runtime

from .. import cache, tuning
from ..render import CSRC, Templates
from . import configs

TEMPLATES = Templates(Path(__file__).parent / "templates", csrc=("slstm",))
INCLUDE = CSRC / "slstm"


def _cuda_core():
    """cuda.core's names (cuda-core >= 0.4 exports them at the top; older releases in .experimental)."""
    try:
        import cuda.core as cc

        cc.Program  # noqa: B018 - present from 0.4 on
    except (ImportError, AttributeError):
        import cuda.core.experimental as cc
    return cc


def available() -> str | None:
    """None when the kernel can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (9, 0):
        return "thread-block clusters need sm_90 or newer"
    try:
        _cuda_core()
    except ImportError as e:
        return f"cuda-python's cuda.core is not installed ({e})"
    return None


def render(D: int, NH: int, cfg: dict, dtype: torch.dtype, fresh: str, clamp_gates: bool,
           clamp_n: bool) -> tuple[str, str]:
    """(kernel name, source) of the forward specialised to these constants."""
    values = dict(D=D, NH=NH, BT=configs.BT, dtype=str(dtype).removeprefix("torch."), fresh=fresh,
                  clamp_gates=clamp_gates, clamp_n=clamp_n, **cfg)
    tag = hashlib.sha256(repr(sorted(values.items())).encode() + TEMPLATES.digest.encode()).hexdigest()[:16]
    name = f"xaccel_slstm_forward_{tag}"
    return name, TEMPLATES.render("slstm_forward.cu.jinja", name=name, **values)


def compile_cubin(name: str, source: str, arch: str) -> bytes:
    """NVRTC: source -> cubin for `arch` (e.g. "sm_90a"); needs no GPU."""
    cc = _cuda_core()
    options = cc.ProgramOptions(arch=arch, std="c++17", include_path=[str(INCLUDE)], name=name)
    return bytes(cc.Program(source, "c++", options).compile("cubin").code)


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


@functools.lru_cache(maxsize=None)
def _kernel(name: str, source: str, arch: str, device_index: int):
    path = cache.root() / "slstm" / f"{name}.{arch}.cubin"
    try:
        cubin = path.read_bytes()
    except OSError:
        cubin = None
    if not cubin:
        cubin = compile_cubin(name, source, arch)
        cache.atomic_write(path, cubin)
        cache.atomic_write(path.with_suffix(".cu"), source)  # readable beside its build
    cc = _cuda_core()
    cc.Device(device_index).set_current()
    return cc.ObjectCode.from_cubin(cubin).get_kernel(name)


_STREAMS: dict = {}


def _stream(cc, device_index: int):
    """torch's current stream as a cuda.core Stream (wrapped once per stream)."""
    s = torch.cuda.current_stream()
    wrapped = _STREAMS.get(s.cuda_stream)
    if wrapped is None:
        wrapped = _STREAMS[s.cuda_stream] = cc.Device(device_index).create_stream(s)
    return wrapped


def launch(cfg: dict, Wx, R, b, h0, c0, n0, m0, first_fresh, fresh, clamp_gates, clamp_n):
    B, T, _, NH, D = Wx.shape
    name, source = render(D, NH, cfg, Wx.dtype, fresh, clamp_gates, clamp_n)
    kernel = _kernel(name, source, _arch(Wx.device), Wx.device.index or 0)
    y = Wx.new_empty(B, T, NH, D)
    finals = [Wx.new_empty(B, NH, D, dtype=torch.float32) for _ in range(4)]
    if T == 0 and h0 is not None:
        for out, s in zip(finals, (h0, c0, n0, m0)):
            out.copy_(s)
        return (y, *finals)
    cc = _cuda_core()
    blocks = NH * math.ceil(B / configs.BT) * cfg["C"]
    flag = first_fresh if isinstance(first_fresh, torch.Tensor) else None

    def ptr(t):
        return 0 if t is None else t.data_ptr()

    cc.launch(_stream(cc, Wx.device.index or 0), cc.LaunchConfig(grid=blocks, block=cfg["NW"] * 32), kernel,
              ptr(Wx), Wx.stride(0), Wx.stride(1), ptr(R), ptr(b), ptr(h0), ptr(c0), ptr(n0), ptr(m0), ptr(flag),
              _int(0 if flag is not None else int(first_fresh)), ptr(y), *(ptr(f) for f in finals), _int(B), _int(T))
    return (y, *finals)


def _int(v: int):
    import numpy as np

    return np.int32(v)


def _takes(Wx, R, b) -> str | None:
    """None when the kernel covers the case, else why not (for the report)."""
    if not Wx.is_cuda:
        return "not a CUDA tensor"
    if Wx.dtype not in configs.DTYPES:
        return f"{Wx.dtype} (the cluster kernel takes bf16 and fp16)"
    if R.dtype != Wx.dtype:
        return f"R is {R.dtype}, Wx {Wx.dtype}"
    if configs.default(Wx.shape[-1]) is None:
        return f"head dim {Wx.shape[-1]} (R does not fit one cluster's registers)"
    return available()


def _aligned(Wx):
    """Wx with its [4, NH, D] part dense and the batch and time strides even (32-bit loads)."""
    _, _, _, NH, D = Wx.shape
    ok = Wx.stride()[2:] == (NH * D, D, 1) and Wx.stride(0) % 2 == 0 and Wx.stride(1) % 2 == 0 \
        and Wx.data_ptr() % 4 == 0
    return Wx if ok else Wx.contiguous()


def _first_fresh(fresh, n0):
    """The batch rule's fresh flag for the first step (later steps are never fresh under it: once
    any n > 0 or NaN, one stays so); a device tensor where it depends on n0, or None where only
    the reference can say (an n0 with negative entries and none positive)."""
    if n0 is None:
        return 1
    if fresh == "element":
        return 0
    if not bool(((n0 > 0) | n0.isnan()).any() | (n0 == 0).all()):
        return None
    return (n0 == 0).all().to(torch.int32).reshape(1)


def _tuned_config(key, Wx, run):
    D = Wx.shape[-1]
    cands = configs.candidates(D)
    parts = f"fwd|D{D}|NH{Wx.shape[3]}|B{Wx.shape[0]}|T{min(Wx.shape[1], 256)}|{Wx.dtype}|{key[7:]}"
    tkey = tuning.key("slstm", parts, Wx.device, TEMPLATES.digest)

    def tune():
        timings: list = []
        best = tuning.fastest("slstm forward", cands, lambda c: tuning.gpu_ms(lambda: run(c), calls=3, rounds=3),
                              timings=timings)
        if best is None:
            raise RuntimeError(f"no sLSTM kernel configuration ran: {timings}")
        return {"config": best, "timings": timings}

    def valid(entry):
        return isinstance(entry, dict) and entry.get("config") in cands

    return tuning.decide(tkey, untimed=configs.default(D), valid=valid, tune=tune, memo=_DECISIONS).config


_DECISIONS: dict = {}


def forward(key, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n):
    """Kernel path for xaccel::slstm, or NotImplemented where it does not apply."""
    if _takes(Wx, R, b) is not None:
        return NotImplemented
    first_fresh = _first_fresh(fresh, n0)
    if first_fresh is None:
        return NotImplemented
    Wx = _aligned(Wx)
    R = R.contiguous()
    b = b.float().contiguous()
    states = [None if s is None else s.float().contiguous() for s in (h0, c0, n0, m0)]
    short = Wx[:, :min(Wx.shape[1], 256)]

    def run(cfg, W=Wx):
        return launch(cfg, W, R, b, *states, first_fresh, fresh, clamp_gates, clamp_n)

    cfg = _tuned_config(key, Wx, lambda c: run(c, short))
    runtime.record_choice(key, "slstm", f"B{Wx.shape[0]} T{Wx.shape[1]} NH{Wx.shape[3]} D{Wx.shape[4]}",
                          f"cuda cluster C{cfg['C']} warps{cfg['NW']}")
    return run(cfg)


def why_not(Wx, R, b) -> str | None:
    """For the report: why the cluster kernel does not take this case (None: it does)."""
    return _takes(Wx, R, b)
