"""The sLSTM sequence as one persistent CUDA kernel (forward, and a reverse-time backward): rendered
from templates/slstm_{forward,backward}.cu.jinja (device helpers in csrc/slstm/), built with NVRTC
through cuda-python's cuda.core, cached as a cubin under XACCEL_CACHE_DIR/slstm/, launched on
torch's current stream. A head runs on one Hopper thread-block cluster where its R fits one
(exchange "cluster"), else on a group of CTAs of a cooperative grid that exchange h through L2
(exchange "global": wider heads, and GPUs without clusters). Cases neither covers return
NotImplemented (the runtime then runs the next provider or the reference); a failed build or
launch raises, and the runtime reports it and falls back."""
from __future__ import annotations

import functools
import hashlib
import math
from pathlib import Path

import torch

from torch_xaccel import runtime
from torch_xaccel.ops.slstm import reference, reference_backward

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
    """None when a kernel can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (8, 0):
        return "the kernels need sm_80 or newer (bf16 tensor-core MMA, cp.async)"
    try:
        _cuda_core()
    except ImportError as e:
        return f"cuda-python's cuda.core is not installed ({e})"
    return None


def render(kernel: str, D: int, NH: int, cfg: dict, dtype: torch.dtype, fresh: str, clamp_gates: bool,
           clamp_n: bool, save: bool = False) -> tuple[str, str]:
    """(kernel name, source) of the forward ("forward") or backward ("backward") specialised to
    these constants. save: the forward also writes what the backward reads."""
    return _rendered(kernel, D, NH, tuple(sorted(cfg.items())), dtype, fresh, clamp_gates, clamp_n, save)


@functools.lru_cache(maxsize=256)
def _rendered(kernel: str, D: int, NH: int, cfg: tuple, dtype: torch.dtype, fresh: str, clamp_gates: bool,
              clamp_n: bool, save: bool) -> tuple[str, str]:
    """render() once per process and case: every launch asks for its kernel's source."""
    cfg = dict(cfg)
    values = dict(D=D, NH=NH, BT=configs.BT, dtype=str(dtype).removeprefix("torch."), fresh=fresh,
                  clamp_gates=clamp_gates, clamp_n=clamp_n, save=save, share_bytes=configs.share_bytes(dtype), **cfg)
    tag = hashlib.sha256(repr(sorted(values.items())).encode() + TEMPLATES.digest.encode()).hexdigest()[:16]
    name = f"xaccel_slstm_{kernel}_{tag}"
    return name, TEMPLATES.render(f"slstm_{kernel}.cu.jinja", name=name, **values)


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


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _groups(Wx) -> int:
    """(head, batch tile) pairs: one cluster or grid group each."""
    return Wx.shape[3] * math.ceil(Wx.shape[0] / configs.BT)


def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(Wx) -> tuple[str, int | None] | str:
    """(exchange, max_group) of this case's kernels, or why none runs (for the report). Clusters
    where the head fits one (sm_90); else a cooperative grid of one CTA per SM: max_group is how
    many CTAs each (head, batch tile) group may have."""
    return _plan(Wx.shape[0], Wx.shape[3], Wx.shape[-1], Wx.element_size(),
                 torch.cuda.get_device_capability(Wx.device), _sm_count(Wx.device))


@functools.lru_cache(maxsize=1024)
def _plan(B: int, NH: int, D: int, itemsize: int, capability: tuple, sms: int):
    """plan() per shape and device: a call asks several times (forward, tuning, backward)."""
    if capability >= (9, 0) and configs.default(D, itemsize=itemsize) is not None:
        return "cluster", None
    groups = NH * math.ceil(B / configs.BT)
    if configs.default(D, "global", sms // groups, itemsize) is not None:
        return "global", sms // groups
    return (f"head dim {D} at B{B} NH{NH}: R fits neither one cluster nor {groups} group(s) of "
            f"CTAs, one per SM, on the {sms} SMs")


def _launch_config(cc, blocks: int, threads: int, shared: int, cooperative: bool):
    """cuda.core's LaunchConfig; cooperative (every CTA resident at once, or the launch fails) is
    `is_cooperative` in recent releases, `cooperative_launch` in older ones."""
    if not cooperative:
        return cc.LaunchConfig(grid=blocks, block=threads, shmem_size=shared)
    for flag in ("is_cooperative", "cooperative_launch"):
        try:
            return cc.LaunchConfig(grid=blocks, block=threads, shmem_size=shared, **{flag: True})
        except TypeError:
            continue
    raise RuntimeError("this cuda.core cannot launch cooperative kernels (the global exchange needs them)")


def _run(kernel_name: str, cfg: dict, Wx, fresh, clamp_gates, clamp_n, save, *args, shared: int = 0) -> None:
    """Launch one kernel: Python ints pass as 64-bit values (addresses, strides), _int() as int.
    shared: dynamic shared memory bytes."""
    _, _, _, NH, D = Wx.shape
    name, source = render(kernel_name, D, NH, cfg, Wx.dtype, fresh, clamp_gates, clamp_n, save)
    device = Wx.device.index or 0
    kernel = _kernel(name, source, _arch(Wx.device), device)
    if shared:
        _allow_shared(kernel, shared, device)
    cc = _cuda_core()
    blocks = _groups(Wx) * cfg["C"]
    config = _launch_config(cc, blocks, cfg["NW"] * 32, shared, cfg["exchange"] == "global")
    cc.launch(_stream(cc, device), config, kernel, *args)


def _exchange_buffer(Wx, cfg: dict, data_bytes_per_group: int) -> tuple:
    """The global exchange's buffer of flagged words (none for clusters): 8 bytes per 4 of data,
    zeroed (no word carries a step's tag before that step writes it)."""
    if cfg["exchange"] != "global":
        return ()
    return torch.zeros(_groups(Wx) * 2 * data_bytes_per_group, dtype=torch.uint8, device=Wx.device),


_SHARED_SET: dict = {}


def _allow_shared(kernel, nbytes: int, device: int) -> None:
    """Raise the kernel's dynamic shared memory limit (48 KB unless asked) once per kernel."""
    if _SHARED_SET.get((id(kernel), device), 0) >= nbytes:
        return
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    handle = kernel.handle
    if isinstance(handle, driver.CUkernel):
        err, = driver.cuKernelSetAttribute(attr, nbytes, handle, device)
    else:
        err, = driver.cuFuncSetAttribute(handle, attr, nbytes)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"could not allow {nbytes} bytes of dynamic shared memory: {err}")
    _SHARED_SET[(id(kernel), device)] = nbytes


def launch(cfg: dict, Wx, R, b, h0, c0, n0, m0, first_fresh, fresh, clamp_gates, clamp_n, save=False):
    """(y, hT, cT, nT, mT), and with save the backward's inputs (raw [B, T, 4, NH, D] and c, n, m
    [3, B, T, NH, D], fp32)."""
    B, T, _, NH, D = Wx.shape
    y = Wx.new_empty(B, T, NH, D)
    finals = [Wx.new_empty(B, NH, D, dtype=torch.float32) for _ in range(4)]
    kept = (Wx.new_empty(B, T, 4, NH, D, dtype=torch.float32), Wx.new_empty(3, B, T, NH, D, dtype=torch.float32)) \
        if save else (None, None)
    if T == 0:
        for out, s in zip(finals, (h0, c0, n0, m0)):
            out.copy_(s) if s is not None else out.zero_()
        return (y, *finals, *kept) if save else (y, *finals)
    flag = first_fresh if isinstance(first_fresh, torch.Tensor) else None
    exchange = _exchange_buffer(Wx, cfg, 2 * configs.BT * D * Wx.element_size())  # h_t double buffered
    _run("forward", cfg, Wx, fresh, clamp_gates, clamp_n, save,
         _ptr(Wx), Wx.stride(0), Wx.stride(1), _ptr(R), _ptr(b), _ptr(h0), _ptr(c0), _ptr(n0), _ptr(m0), _ptr(flag),
         _int(0 if flag is not None else int(first_fresh)), _ptr(y), *(_ptr(f) for f in finals), _ptr(kept[0]),
         _ptr(kept[1]), _int(B), _int(T), *(_ptr(t) for t in exchange),
         shared=configs.forward_shared_bytes(D, cfg, Wx.element_size()))
    return (y, *finals, *kept) if save else (y, *finals)


def _int(v: int):
    import numpy as np

    return np.int32(v)


def _takes(Wx, R, b) -> str | None:
    """None when a kernel covers the case, else why not (for the report)."""
    if not Wx.is_cuda:
        return "not a CUDA tensor"
    if Wx.dtype not in configs.ENABLED_DTYPES:
        return f"{Wx.dtype} (the sequence kernels run {', '.join(map(str, configs.ENABLED_DTYPES))})"
    if R.dtype != Wx.dtype:
        return f"R is {R.dtype}, Wx {Wx.dtype}"
    why = available()
    if why is not None:
        return why
    chosen = plan(Wx)
    return chosen if isinstance(chosen, str) else None


def _aligned(Wx):
    """Wx with its [4, NH, D] part dense and the batch and time strides even (each thread loads two
    adjacent units: 32 bits, 64 in fp32)."""
    _, _, _, NH, D = Wx.shape
    ok = Wx.stride()[2:] == (NH * D, D, 1) and Wx.stride(0) % 2 == 0 and Wx.stride(1) % 2 == 0 \
        and Wx.data_ptr() % (2 * Wx.element_size()) == 0
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
    exchange, max_group = plan(Wx)
    cands = configs.candidates(D, exchange, max_group, Wx.element_size())
    parts = f"fwd|D{D}|NH{Wx.shape[3]}|B{Wx.shape[0]}|T{min(Wx.shape[1], 256)}|{Wx.dtype}|{exchange}|{key[7:]}"
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

    return tuning.decide(tkey, untimed=configs.default(D, exchange, max_group, Wx.element_size()), valid=valid,
                         tune=tune, memo=_DECISIONS).config


_DECISIONS: dict = {}


def forward(key, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n, save=False):
    """Kernel path for xaccel::slstm (save: xaccel::slstm_saving, also writing what the backward
    kernel reads), or NotImplemented where it does not apply."""
    if _takes(Wx, R, b) is not None or save and _backward_config(Wx) is None:
        return NotImplemented
    first_fresh = _first_fresh(fresh, n0)
    if first_fresh is None:
        return NotImplemented
    Wx, R, b, states = _prepared(Wx, R, b, (h0, c0, n0, m0))
    short = Wx[:, :min(Wx.shape[1], 256)]  # tuning times a slice: the per-step cost is what differs
    cfg = _tuned_config(key, Wx, lambda c: launch(c, short, R, b, *states, first_fresh, fresh, clamp_gates, clamp_n))
    runtime.record_choice(key, "slstm_saving" if save else "slstm",
                          f"B{Wx.shape[0]} T{Wx.shape[1]} NH{Wx.shape[3]} D{Wx.shape[4]}",
                          _described(cfg))
    head = Wx[:, :CHECK_STEPS]
    if head.shape[1]:
        _self_check("forward", key, cfg, Wx.dtype,
                    lambda: launch(cfg, head, R, b, *states, first_fresh, fresh, clamp_gates, clamp_n),
                    lambda: reference.forward(head, R, b, *states, fresh, clamp_gates, clamp_n))
    return launch(cfg, Wx, R, b, *states, first_fresh, fresh, clamp_gates, clamp_n, save=save)


CHECK_STEPS = 16
# norm-relative error a kernel may show against the reference on its first CHECK_STEPS steps
# (16-bit: h and the products rounded to 16 bits; fp32: 3xTF32 products and fast exp/tanh)
CHECK_TOLERANCE = {"forward": {2: 2e-2, 4: 1e-4}, "backward": {2: 5e-2, 4: 2e-4}}
_AGREED: set = set()


def _self_check(kind: str, key, cfg: dict, dtype, kernel, want) -> None:
    """At a case's first call in this process (outside a CUDA-graph capture), the kernel on the
    sequence's first steps against the reference: a kernel that disagrees (a miscompile, a GPU
    the kernels were never run on) raises, and the runtime reports it and runs the reference."""
    mark = (kind, key, tuple(sorted(cfg.items())))
    if mark in _AGREED or tuning.capturing():
        return
    tol = CHECK_TOLERANCE[kind][dtype.itemsize]
    for i, (g, w) in enumerate(zip(kernel(), want())):
        if g is None or w is None:
            continue
        scale = w.double().norm()
        err = ((g.double() - w.double()).norm() / scale).item() if scale > 0 else g.double().norm().item()
        if not err <= tol:
            raise RuntimeError(f"the {kind} kernel ({_described(cfg)}) disagrees with the reference on the first "
                               f"{CHECK_STEPS} steps: output {i} off by {err:.1e} (tolerance {tol:.0e})")
    _AGREED.add(mark)


def _described(cfg: dict) -> str:
    return f"cuda {cfg['exchange']} exchange C{cfg['C']} warps{cfg['NW']}"


def _backward_config(Wx) -> dict | None:
    """The backward's configuration: the forward's exchange, else the global one (both read what
    either forward keeps)."""
    chosen = plan(Wx)
    if isinstance(chosen, str):
        return None
    D, itemsize = Wx.shape[-1], Wx.element_size()
    return configs.backward_default(D, *chosen, itemsize) or \
        configs.backward_default(D, "global", _sm_count(Wx.device) // _groups(Wx), itemsize)


def forward_saving(key, *args):
    """Kernel path for xaccel::slstm_saving."""
    return forward(key, *args, save=True)


def _prepared(Wx, R, b, states):
    return _aligned(Wx), R.contiguous(), b.float().contiguous(), [None if s is None else s.float().contiguous()
                                                                    for s in states]


def _check_backward(key, cfg, Wx, R, b, states, first_fresh, fresh, clamp_gates, clamp_n) -> None:
    """_self_check of the backward: every gradient of the first steps under a random output
    gradient, against the reference backward."""
    head = Wx[:, :CHECK_STEPS]
    g = torch.Generator(device=Wx.device).manual_seed(0)
    gy = torch.randn(head.shape[0], head.shape[1], *head.shape[3:], device=Wx.device, generator=g).to(Wx.dtype)

    def kernel():
        W, Rc, bc, prepared = _prepared(head, R, b, states)
        y = launch(configs.default(Wx.shape[-1], *plan(Wx), Wx.element_size()), W, Rc, bc, *prepared, first_fresh,
                   fresh, clamp_gates, clamp_n)[0]
        return backward(key, gy, None, None, None, None, head, R, b, *states, fresh, clamp_gates, clamp_n, y, None,
                        checked=True)
    _self_check("backward", key, cfg, Wx.dtype, kernel, lambda: reference_backward.backward(
        gy, None, None, None, None, head, R, b, *states, fresh, clamp_gates, clamp_n))


def backward(key, gy, ghT, gcT, gnT, gmT, Wx, R, b, h0, c0, n0, m0, fresh, clamp_gates, clamp_n, y, kept,
             checked=False):
    """Kernel path for xaccel::slstm_backward: the reverse-time cluster kernel for dWx and the
    initial states' gradients, then dR and db as reductions of dWx (one GEMM, one sum)."""
    D = Wx.shape[-1]
    if _takes(Wx, R, b) is not None or (cfg := _backward_config(Wx)) is None:
        return NotImplemented
    first_fresh = _first_fresh(fresh, n0)
    if first_fresh is None:
        return NotImplemented
    B, T, _, NH, _ = Wx.shape
    W, Rc, bc, states = _prepared(Wx, R, b, (h0, c0, n0, m0))
    if not checked and T > 0:
        _check_backward(key, cfg, Wx, R, b, (h0, c0, n0, m0), first_fresh, fresh, clamp_gates, clamp_n)
    if kept:
        raw, cnm = kept
    else:  # an op called outside a training graph: run the forward again, keeping what the kernel reads
        fcfg = configs.default(D, *plan(Wx), Wx.element_size())
        raw, cnm = launch(fcfg, W, Rc, bc, *states, first_fresh, fresh, clamp_gates, clamp_n, save=True)[5:]
    dWx = Wx.new_empty(B, T, 4, NH, D)
    has_state = h0 is not None
    state_grads = [Wx.new_empty(B, NH, D, dtype=torch.float32) for _ in range(4)] if has_state else [None] * 4
    finals = [None if g is None else g.float().contiguous() for g in (ghT, gcT, gnT, gmT)]
    dy = None if gy is None else gy.to(Wx.dtype).contiguous()
    runtime.record_choice(key, "slstm_backward", f"B{B} T{T} NH{NH} D{D}", _described(cfg))
    if T > 0:
        flag = first_fresh if isinstance(first_fresh, torch.Tensor) else None
        share = configs.share_bytes(Wx.dtype)
        exchange = _exchange_buffer(Wx, cfg, 2 * cfg["C"] * configs.BT * D * share)  # [2][owner][sender][BT][U]
        _run("backward", cfg, W, fresh, clamp_gates, clamp_n, False,
             _ptr(raw), _ptr(cnm), _ptr(Rc), *(_ptr(s) for s in states[1:]), _ptr(flag),
             _int(0 if flag is not None else int(first_fresh)), _ptr(dy), *(_ptr(f) for f in finals), _ptr(dWx),
             *(_ptr(g) for g in state_grads), _int(B), _int(T), *(_ptr(t) for t in exchange),
             shared=configs.backward_shared_bytes(D, cfg["U"], cfg["NW"], cfg["STAGES"], share, Wx.element_size()))
    else:
        dWx.zero_()
        for g, f in zip(state_grads, finals):
            if g is not None:
                g.copy_(f) if f is not None else g.zero_()
    db = dWx.sum((0, 1), dtype=torch.float32).to(b.dtype)
    h_first = (h0.to(Wx.dtype) if has_state else Wx.new_zeros(B, NH, D)).unsqueeze(1)
    h_prev = torch.cat((h_first, y[:, :-1].to(Wx.dtype)), 1)  # the h each step's product read
    dR = _weight_gradient(dWx, h_prev).to(R.dtype)
    grads = [dWx, dR, db]
    if has_state:
        grads += [g.to(s.dtype) for g, s in zip(state_grads, (h0, c0, n0, m0))]
    return grads


def _weight_gradient(dWx, h_prev):
    """dR[h, g] = sum over (b, t) of dWx[b, t, g, h, :]^T h_prev[b, t, h, :]: one batched GEMM per
    gate over strided views (no copy of dWx)."""
    B, T, _, NH, D = dWx.shape
    H = h_prev.reshape(B * T, NH, D).transpose(0, 1)  # [NH, B*T, D]
    # dWx[:, :, g] as [NH, B*T, D]: rows 4*NH*D apart, a view
    return torch.stack([torch.bmm(dWx[:, :, g].reshape(B * T, NH, D).transpose(0, 1).transpose(1, 2), H)
                        for g in range(4)], 1)


def backward_reads_kept_states(Wx, R) -> bool:
    """Whether a training graph's xaccel.slstm should keep its per-step states: the backward
    kernel runs for this case (a CUDA device it runs on, the dtype and shape it takes)."""
    return Wx.device.type == "cuda" and Wx.dtype in configs.ENABLED_DTYPES and R.dtype == Wx.dtype \
        and available() is None and _backward_config(Wx) is not None


def why_not(Wx, R, b) -> str | None:
    """For the report: why no sequence kernel takes this case (None: one does)."""
    return _takes(Wx, R, b)
