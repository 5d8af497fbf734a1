"""A compiled Triton kernel launched again without JITFunction.run's per-call work.

JITFunction.run binds every argument, builds the specialization key, looks the kernel up and asks
the driver for the device and stream on each launch: host time that a one-token decode pays for
every kernel it launches (the GEMM chains' launch plans, the mLSTM step). A DirectLaunch keeps the
CompiledKernel of one earlier launch and calls its launcher, as JITFunction.run itself does last.

That is only the same kernel while Triton would pick the same specialization: the caller keeps
the integer arguments and constexprs fixed (a plan's shapes and strides), and `matches` checks
what varies between calls, the tensors' dtypes and 16-byte alignment, and the current device."""
from __future__ import annotations

import torch


def _guard(tensors) -> tuple:
    return tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors)


def remember(table: dict, key, value, limit: int) -> None:
    """table[key] = value, the table started over once it holds `limit` entries: launch plans are
    keyed by exact shapes, and a server seeing many batch sizes would otherwise grow them without
    bound."""
    if len(table) >= limit:
        table.clear()
    table[key] = value


class DirectLaunch:
    """The CompiledKernel that `kernel[grid](*args, **meta)` returned, ready to launch again on
    arguments in the same positions (`tensors`: those that vary between calls)."""

    __slots__ = ("runner", "consts", "device", "guard")

    def __init__(self, runner, consts: tuple, device: int, guard: tuple):
        self.runner, self.consts, self.device, self.guard = runner, consts, device, guard

    @classmethod
    def capture(cls, kernel, compiled, grid: tuple, meta: dict, n_args: int, tensors) -> "DirectLaunch | None":
        """From a launch that just ran through JITFunction.run (`compiled` is what it returned),
        or None where that launch did not leave a reusable kernel (interpreter, async compile, a
        parameter with a default the caller did not pass)."""
        if compiled is None or not hasattr(compiled, "function") or not torch.cuda.is_available():
            return None
        names = list(kernel.arg_names)[n_args:]  # the constexprs after the positional arguments
        if any(name not in meta for name in names):
            return None
        try:
            runner = compiled[tuple(grid) + (1,) * (3 - len(grid))]  # Triton's own launcher of a compiled kernel
        except Exception:  # noqa: BLE001 - an API this Triton lacks: keep launching through run()
            return None
        return cls(runner, tuple(meta[name] for name in names), torch.cuda.current_device(), _guard(tensors))

    def matches(self, tensors) -> bool:
        return torch.cuda.current_device() == self.device and _guard(tensors) == self.guard

    def __call__(self, args) -> None:
        self.runner(*args, *self.consts, stream=torch._C._cuda_getCurrentRawStream(self.device))


class LaunchCache:
    """Launches of one kernel family: the first call per key through JITFunction.run, later ones
    of the same key straight to its DirectLaunch. The key must fix every integer argument and
    constexpr (shapes, strides, tile sizes); `tensors` are the arguments that vary between calls."""

    def __init__(self, limit: int = 1024):
        self.limit, self.entries = limit, {}

    def launch(self, key, kernel, grid: tuple, args: tuple, meta: dict, tensors) -> None:
        direct = self.entries.get(key)
        if direct and direct.matches(tensors):
            direct(args)
            return
        compiled = kernel[grid](*args, **meta)
        if direct is None:
            remember(self.entries, key, DirectLaunch.capture(kernel, compiled, grid, meta, len(args), tensors) or False,
                     self.limit)

    def launch_any(self, kernel, grid: tuple, args: tuple, meta: dict) -> None:
        """launch() with the key made from the call itself: the kernel, the grid, the constexprs and
        every argument that is not a tensor or a float (integers and None specialise the compiled
        kernel; a float is passed as fp32 whatever its value). For kernels whose shapes and
        strides vary with the case, at a few microseconds a call for the key."""
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
        key = (kernel, tuple(grid), tuple(meta.items()),
               tuple(_TENSOR if isinstance(a, torch.Tensor) else float if isinstance(a, float) else a for a in args))
        self.launch(key, kernel, grid, args, meta, tensors)


_TENSOR = object()  # a tensor's place in launch_any's key (its dtype and alignment are the guard's)
