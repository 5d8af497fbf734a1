"""The sweep's runner: `python -m torch_xaccel.bench sweep [options]`.

Each row (a model form at one size, dtype and mode) runs in its own process
(`python -m torch_xaccel.sweep.run --row '<json>'`, a per-row timeout), so Dynamo caches and GPU
memory do not leak from row to row and a row that fails or hangs is a row with its error. In a
row: the model (seeded), three variants of it (eager; `torch.compile(model)`;
`torch.compile(model, backend="xaccel")`, each on its own deepcopy), the first call of each timed
(cold compile), a few warm-up calls, then interleaved rounds (each round calls every variant k
times back to back, synchronized before and after: host + GPU, what a plain call costs) until
each variant has at least 7 rounds and the rounds took ~1.5 s (at most 60); the median per
variant. xaccel's output (and for train rows a few parameters' gradients) is checked against
eager's and against an fp32 (fp64 for fp32 rows) reference.

Row processes get no XACCEL_* variable but XACCEL_CACHE_DIR, XACCEL_COMMIT and
XACCEL_COMPILE_THREADS (where the kernels go, what the header names, how many compile threads: not
what runs): xaccel as a user gets it by default. `--env KEY=VALUE` sets one for every row.

Caches: by default each row starts with empty ones (xaccel's kernel cache, tunings and stored
choices; Inductor's and Triton's, one set per compiled variant), so first calls are cold compiles
and no variant's compile feeds another's; `--warm-caches` keeps the environment's (faster reruns).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from torch_xaccel.sweep import forms

VARIANTS = ("eager", "inductor", "xaccel")
ROUND_MS = 10.0  # one variant's k back-to-back calls per round take about this long
MAX_K = 64
MAX_ROUNDS = 60
KEPT_ENV = ("XACCEL_CACHE_DIR", "XACCEL_COMMIT", "XACCEL_COMPILE_THREADS")

# Correctness: xaccel is WRONG on an output or gradient when its relative error (Frobenius norm of
# the difference over the reference's) against the higher-precision reference exceeds
#   3 x eager's own error against the same reference + a floor.
# 16-bit rows (reference: the model in fp32): floor 1e-3. bf16 keeps 8 significant bits (unit
# roundoff 2^-8 = 3.9e-3), so merely rounding an output to bf16 costs ~2e-3; eager's error is at
# least that, and the floor only matters where eager's error is tiny.
# fp32 rows (reference: the model in fp64): floor 1e-4 with torch's default fp32 matmul precision
# ("highest": fp32 products and sums, errors ~1e-6..1e-5 here; 1e-4 leaves room for the exp/log of
# the recurrences over thousands of steps, and flags a kernel that drops to TF32 on its own), 1e-3
# under --precision high (TF32 operands keep 10 mantissa bits, unit roundoff 2^-11 = 4.9e-4: a
# GEMM output's relative error is ~1e-4..1e-3).
FLOOR_16BIT = 1e-3
FLOOR_FP32 = {"highest": 1e-4, "high": 1e-3}
TIMES_EAGER = 3.0


# ------------------------------------------------------------------------------------------------
# one row, in its own process


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _oneline(e: BaseException, n: int) -> str:
    """An exception's message on one line (the table's cells), without Dynamo's boilerplate, cut to n characters."""
    return " ".join(str(e).split("Set TORCHDYNAMO_VERBOSE=1")[0].split())[:n]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def _make_call(row: dict, module: torch.nn.Module, fn, inputs: tuple):
    """One call of a variant: the forward under inference_mode, or for train rows a whole step
    (grads set to None, forward, loss, backward), the same work in every variant."""
    if row["mode"] == "train":
        def call():
            module.zero_grad(set_to_none=True)
            out = fn(*inputs)
            forms.loss_of(row, out, inputs).backward()
            return out.detach()
    else:
        def call():
            with torch.inference_mode():
                return fn(*inputs)
    return call


def _checked_params(model: torch.nn.Module) -> list[str]:
    """A few parameters whose gradients train rows compare: the first, one in the middle, the last."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    picked = [names[0], names[len(names) // 2], names[-1]] if names else []
    return list(dict.fromkeys(picked))


def _outputs(row, module, out, names) -> dict:
    """The tensors a variant's call is checked on: its output and, for train rows, its gradients."""
    got = {"out": out.detach()}
    if row["mode"] == "train":
        params = dict(module.named_parameters())
        for n in names:
            g = params[n].grad
            got[f"grad {n}"] = g.detach().clone() if g is not None else None
    return got


def _errors(row, got: dict, precision: str) -> dict:
    """Relative errors of each checked tensor and the verdict."""
    ref = got.get("reference")
    floor = FLOOR_16BIT if row["dtype"] != "fp32" else FLOOR_FP32[precision]
    items, wrong, inductor_wrong = {}, [], []
    for key, x in got["xaccel"].items():
        e = got["eager"].get(key)
        i = got.get("inductor", {}).get(key)
        r = ref.get(key) if ref else None
        if x is None or e is None:
            items[key] = {"note": "no gradient"}
            continue
        it = {"xaccel_vs_eager": _rel(x, e)}
        if i is not None:
            it["inductor_vs_eager"] = _rel(i, e)
        if r is not None:
            it["xaccel_vs_ref"], it["eager_vs_ref"] = _rel(x, r), _rel(e, r)
            if i is not None:
                it["inductor_vs_ref"] = _rel(i, r)
            bound = TIMES_EAGER * it["eager_vs_ref"] + floor
            it["bound"] = bound
            e_finite = bool(torch.isfinite(e).all())

            def off(t, err):  # non-finite where eager is finite, or past the bound
                return (not bool(torch.isfinite(t).all()) and e_finite) or (math.isfinite(bound) and not err <= bound)
            if off(x, it["xaccel_vs_ref"]):
                wrong.append(key)
            if i is not None and off(i, it["inductor_vs_ref"]):
                inductor_wrong.append(key)
        items[key] = it
    xs = [v.get("xaccel_vs_ref", v.get("xaccel_vs_eager")) for v in items.values() if "xaccel_vs_eager" in v]
    es = [v["eager_vs_ref"] for v in items.values() if "eager_vs_ref" in v]
    worst = max(xs, key=lambda v: -1.0 if v != v else v) if xs else None
    return dict(items=items, wrong=wrong, inductor_wrong=inductor_wrong, floor=floor,
                rule=f"xaccel_vs_ref > {TIMES_EAGER:g} x eager_vs_ref + {floor:g}", xaccel=worst,
                eager=max(es) if es else None, against="reference" if ref else "eager (no reference)")


def _reference(row, model, inputs, names, device):
    """The same call on a copy of the model in fp32 (fp64 for fp32 rows), eagerly."""
    exact = torch.float64 if row["dtype"] == "fp32" else torch.float32
    ref = copy.deepcopy(model).to(exact)
    xs = tuple(t.to(exact) if t.is_floating_point() else t for t in inputs)
    out = _make_call(row, ref, ref, xs)()
    got = _outputs(row, ref, out, names)
    del ref
    return got, str(exact).removeprefix("torch.")


def _settle_cutlass(call) -> str:
    """Background CUTLASS builds of the first call (XACCEL_CUTLASS default 1) finish and their
    cases retune in one untimed call, so the rounds time the steady state rather than a retune:
    torch_xaccel.bench's helper (the family's code stays behind the tools). "" when none was pending."""
    from torch_xaccel.bench.model import _settle_cutlass as settle

    return settle(call).removeprefix(", then ").strip()


@contextlib.contextmanager
def _cold_caches(row: dict, variant: str):
    """Around a compiled variant's first call: Inductor's and Triton's caches in a folder of the
    variant's own under the row's fresh cache root, so neither compile finds the other's work (the
    measured choice of xaccel compiles the graph with Inductor too) nor an earlier run's. Nothing
    with --warm-caches."""
    root = row.get("cache_root")
    if not root:
        yield
        return
    folder = os.path.join(root, variant)
    os.makedirs(folder, exist_ok=True)
    saved = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
    try:
        try:  # also clears Inductor's in-memory caches on the way in and out
            from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
        except ImportError:
            temporary_cache_dir = None
        if temporary_cache_dir is not None:
            with temporary_cache_dir(os.path.join(folder, "inductor")):
                yield
        else:
            saved_ind = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")
            try:
                yield
            finally:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved_ind or ""
                if saved_ind is None:
                    del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    finally:
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved


def _prewarm(row: dict, device: str) -> dict:
    """Compile and run a tiny GEMM + GELU with each compiler first (its own caches, then
    torch._dynamo.reset()): the imports, compile workers and device set-up a process pays once go
    here, so the model's first calls time its own compile whichever variant comes first."""
    dtype = forms.DTYPES[row["dtype"]]
    spent = {}
    for v, kwargs in (("inductor", {}), ("xaccel", {"backend": "xaccel"})):
        torch._dynamo.reset()
        a = torch.randn(16, 64, device=device, dtype=dtype, requires_grad=row["mode"] == "train")
        w = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=row["mode"] == "train")

        def tiny(a, w):
            return F.gelu(a @ w) + a
        t0 = time.perf_counter()
        try:
            with _cold_caches(row, f"prewarm_{v}"):
                out = torch.compile(tiny, **kwargs)(a, w)
                if row["mode"] == "train":
                    out.float().square().mean().backward()
                _sync(device)
            spent[v] = round(time.perf_counter() - t0, 2)
        except Exception as e:  # noqa: BLE001 - not the model: noted, and the row goes on
            spent[v] = f"failed after {time.perf_counter() - t0:.1f}s: {type(e).__name__}: {_oneline(e, 160)}"
            print(f"prewarm {v}: {spent[v]}", flush=True)
    torch._dynamo.reset()
    return spent


def run_row(row: dict, write) -> dict:
    """Measure one row; write(res) after each phase (the parent reads the last one it got, also
    when this process times out or dies)."""
    res = dict(label=forms.label(row), form=row["form"], size=row["size"],
               size_label=forms.size_label(row["form"], row["size"]), dtype=row["dtype"], mode=row["mode"],
               device=row["device"], precision=row["precision"], status="running", phase="start",
               torch=torch.__version__)

    def phase(name):
        res["phase"] = name
        write(res)
        print(f"[{time.strftime('%H:%M:%S')}] {res['label']}: {name}", flush=True)

    why = forms.FORMS[row["form"]].unavailable()
    if why:
        res["status"] = f"skipped: {why}"
        write(res)
        return res
    device = row["device"]
    if device == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    if row["precision"] == "high":
        torch.set_float32_matmul_precision("high")
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        pass
    import torch_xaccel  # noqa: F401 - registers the backend where no entry point is installed
    from torch_xaccel.report import last_report

    try:
        phase("build")
        model, inputs = forms.build(row, device)
        res["params"] = sum(p.numel() for p in model.parameters())
        res["tokens"] = forms.tokens(row)
        copies = {"eager": model, "inductor": copy.deepcopy(model), "xaccel": copy.deepcopy(model)}
        fns = {"eager": model, "inductor": torch.compile(copies["inductor"]),
               "xaccel": torch.compile(copies["xaccel"], backend="xaccel")}
        calls = {v: _make_call(row, copies[v], fns[v], inputs) for v in VARIANTS}
        names = _checked_params(model) if row["mode"] == "train" else []

        phase("prewarm")
        res["prewarm_s"] = _prewarm(row, device)
        res["first_call_s"], failed = {}, {}
        for v in ("eager", "xaccel", "inductor"):  # xaccel's compile before Inductor's: the row's subject
            phase(f"first call {v}")
            t0 = time.perf_counter()
            try:
                with _cold_caches(row, v):
                    calls[v]()
                    _sync(device)
            except Exception as e:  # noqa: BLE001 - a baseline that fails (Inductor, say) is a finding
                if v != "inductor":
                    raise
                import traceback

                traceback.print_exc()
                failed[v] = f"{type(e).__name__}: {_oneline(e, 200)}"
                res["variant_errors"] = failed
                fns[v] = calls[v] = copies[v] = None
                continue
            res["first_call_s"][v] = round(time.perf_counter() - t0, 3)
            if v == "xaccel":
                rep = last_report()
                res["replaced"] = {k: n for k, n in rep.counts().items() if n}
                res["choice"] = [str(getattr(g, "choice", "") or "") for g in rep.graphs]
                res["graphs"] = len(rep.graphs)
                res["fallbacks"] = [f"{f.family}: {f.reason}"[:200] for f in rep.fallbacks][:20]
                phase("settle xaccel")
                settled = _settle_cutlass(calls["xaccel"])
                if settled:
                    res["cutlass_settle"] = settled
        live = [v for v in VARIANTS if v not in failed]

        phase("warm-up")
        got, est = {}, {}
        for v in live:
            calls[v]()
            _sync(device)
            t0 = time.perf_counter()
            out = calls[v]()
            _sync(device)
            est[v] = (time.perf_counter() - t0) * 1e3
            got[v] = _outputs(row, copies[v], out, names)
        phase("reference")
        try:
            got["reference"], res["reference"] = _reference(row, model, inputs, names, device)
        except Exception as e:  # noqa: BLE001 - too large for the device, say: checked against eager only
            res["reference"] = f"failed: {type(e).__name__}: {_oneline(e, 160)}"
        if device == "cuda":
            torch.cuda.empty_cache()
        res["errors"] = _errors(row, got, row["precision"])
        got = out = None

        phase("timing")
        k = int(min(MAX_K, max(1, math.ceil(ROUND_MS / max(statistics.median(est.values()), 1e-3)))))
        times = {v: [] for v in live}
        started = time.perf_counter()
        for r in range(MAX_ROUNDS):
            for v in live:
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(k):
                    calls[v]()
                _sync(device)
                times[v].append((time.perf_counter() - t0) * 1e3 / k)
            if r + 1 >= row["min_rounds"] and time.perf_counter() - started >= row["time_budget_s"]:
                break
        res["k"], res["rounds"] = k, len(times["eager"])
        res["ms"] = {v: statistics.median(t) for v, t in times.items()}
        res["round_ms"] = {v: [round(x, 4) for x in t] for v, t in times.items()}
        # the floor is the faster of the right anchors: an Inductor that answers wrong (NaN
        # gradients on some forms) is no floor
        anchors = [v for v in ("eager", "inductor") if v in res["ms"]
                   and not (v == "inductor" and res["errors"]["inductor_wrong"])]
        best = min(res["ms"][v] for v in anchors)
        res["ratio"] = res["ms"]["xaccel"] / best
        if "inductor" in res["ms"]:
            res["speedup_vs_inductor"] = res["ms"]["inductor"] / res["ms"]["xaccel"]
        rep = last_report()  # the choice text may be filled in after the first call
        res["choice"] = [str(getattr(g, "choice", "") or "") for g in rep.graphs]
        res["chosen"] = [str(getattr(g, "chosen", "") or "") for g in rep.graphs]
        res["region_choices"] = [line for g in rep.graphs for line in getattr(g, "region_choices", [])]
        res["first_call_phases"] = [g.compile_line() for g in rep.graphs]
        graphs_after = len(rep.graphs)
        if graphs_after != res.get("graphs"):
            res["recompiled"] = f"xaccel graphs {res.get('graphs')} after the first call, {graphs_after} after timing"
        wrong = res["errors"]["wrong"]
        res["status"] = "ok" if not wrong else "WRONG" + (
            " (Inductor too)" if set(wrong) <= set(res["errors"]["inductor_wrong"]) else "")
        if res["errors"]["inductor_wrong"] and not wrong:
            res["status"] += f"; Inductor wrong ({', '.join(res['errors']['inductor_wrong'])}): not a floor"
        if failed:
            res["status"] += "; " + "; ".join(f"{v} failed: {why}" for v, why in failed.items())
        res["phase"] = "done"
    except Exception as e:  # noqa: BLE001 - a row that fails is a row with its error
        import traceback

        traceback.print_exc()
        res["status"] = f"error in {res['phase']}: {type(e).__name__}: {_oneline(e, 300)}"
    write(res)
    return res


def _child(args) -> int:
    row = json.loads(args.row)

    def write(res):
        if not args.result:
            return
        tmp = args.result + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(res, fh, default=str)
        os.replace(tmp, args.result)

    res = run_row(row, write)
    if not args.result:
        print(json.dumps(res, default=str))
    return 0


# ------------------------------------------------------------------------------------------------
# the sweep: rows one after another, each in its own process


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def row_env(extra: dict) -> tuple[dict, list]:
    """The row processes' environment: no XACCEL_* but the kept ones, then --env's; and the names
    dropped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XACCEL_") or k in KEPT_ENV}
    dropped = sorted(k for k in os.environ if k.startswith("XACCEL_") and k not in env)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_repo_root(), env.get("PYTHONPATH", "")) if p)
    return env, dropped


def _own_group() -> dict:
    """Popen arguments that start the row in a process group of its own (same session)."""
    return {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def _stop_on_sigterm() -> None:
    """SIGTERM (a `timeout` around the sweep) ends the sweep as Ctrl-C does: the running row's
    process group is ended first."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)


def run_subprocess(row: dict, timeout_s: float, env: dict, log_path: str) -> dict:
    """One row in its own process (its own process group, so a timeout ends it with every compile
    worker it started); the row's last written state, with the error or timeout as its status."""
    work = tempfile.mkdtemp(prefix="xaccel_sweep_row_")  # the row's result file and (cold) caches
    try:
        return _run_in(work, row, timeout_s, env, log_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_in(work: str, row: dict, timeout_s: float, env: dict, log_path: str) -> dict:
    result = os.path.join(work, "result.json")
    if row.get("cold", True):  # every cache the row's compiles use starts empty: first calls are cold
        root = os.path.join(work, "caches")
        row = dict(row, cache_root=root)
        env = dict(env, XACCEL_CACHE_DIR=os.path.join(root, "xaccel"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "rest", "inductor"),
                   TRITON_CACHE_DIR=os.path.join(root, "rest", "triton"))
    t0 = time.perf_counter()
    with open(log_path, "a") as log:
        log.write(f"\n===== {forms.label(row)} =====\n")
        log.flush()
        start = log.tell()
        proc = subprocess.Popen([sys.executable, "-m", "torch_xaccel.sweep.run", "--row", json.dumps(row),
                                 "--result", result], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=_repo_root(), **_own_group())
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:  # Ctrl-C: end the row's process group (its compile workers too), then stop
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if timed_out:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.perf_counter() - t0
    try:
        with open(result) as fh:
            res = json.load(fh)
    except (OSError, ValueError):
        res = dict(label=forms.label(row), form=row["form"], size=row["size"],
                   size_label=forms.size_label(row["form"], row["size"]), dtype=row["dtype"], mode=row["mode"],
                   device=row["device"], phase="start")
    res["row_wall_s"] = round(wall, 1)
    if timed_out:
        res["status"] = f"timeout after {timeout_s:.0f}s in {res.get('phase', '?')}"
    elif proc.returncode != 0 or res.get("status") in (None, "running"):
        res["status"] = f"error: row process exited with {proc.returncode} in {res.get('phase', '?')}"
    if not str(res.get("status", "")).startswith(("ok", "WRONG", "skipped")):
        with open(log_path) as fh:
            fh.seek(start)
            res["log_tail"] = fh.read()[-2000:]
    return res


def _f(v, fmt="{:.3f}", none="-"):
    return none if v is None else fmt.format(v)


def table_row(res: dict) -> dict:
    """One row's table cells."""
    ms = res.get("ms") or {}
    first = res.get("first_call_s") or {}
    err = res.get("errors") or {}
    choice = "; ".join(dict.fromkeys(c for c in res.get("choice", []) if c))
    replaced = ", ".join(f"{k}={v}" for k, v in (res.get("replaced") or {}).items()) or (
        "nothing" if "replaced" in res else "-")
    err_txt = "-"
    if err.get("xaccel") is not None:
        err_txt = f"{err['xaccel']:.1e}"
        if err.get("eager") is not None:
            err_txt += f" (eager {err['eager']:.1e})"
        elif err.get("against"):
            err_txt += " vs eager"
    return {"form": res.get("form", ""), "size": res.get("size_label", ""), "dtype": res.get("dtype", ""),
            "mode": res.get("mode", ""), "eager ms": _f(ms.get("eager")), "inductor ms": _f(ms.get("inductor")),
            "xaccel ms": _f(ms.get("xaccel")), "xaccel/min": _f(res.get("ratio"), "{:.2f}"),
            "ind/xaccel": _f(res.get("speedup_vs_inductor"), "{:.2f}"),
            "first s (ind, xac)": f"{_f(first.get('inductor'), '{:.1f}')}, {_f(first.get('xaccel'), '{:.1f}')}",
            "replaced": replaced, "choice": choice[:80] + ("..." if len(choice) > 80 else ""), "err": err_txt,
            "status": " ".join(str(res.get("status", "")).split())[:160]}


def markdown(results: list, header: str) -> str:
    cells = [table_row(r) for r in results]
    cols = list(cells[0]) if cells else list(table_row({}))
    out = [header, "", "| " + " | ".join(cols) + " |",
           "| " + " | ".join("---:" if c.endswith(("ms", "min", "xaccel")) else "---" for c in cols) + " |"]
    out += ["| " + " | ".join(str(c[k]).replace("|", "/") for k in cols) + " |" for c in cells]
    return "\n".join(out) + "\n"


def summary(results: list) -> list[str]:
    """The closing lines: failed and WRONG rows, then (last) the worst ratio."""
    lines = []
    bad = [r for r in results if r.get("status") not in ("ok",) and not str(r.get("status", "")).startswith("skipped")]
    for r in bad:
        lines.append(f"{r.get('status')}: {r.get('label')}")
    timed = [r for r in results if r.get("ratio") is not None]
    if timed:
        w = max(timed, key=lambda r: r["ratio"])
        ms = w["ms"]
        lines.append(f"worst xaccel / min(eager, inductor, where right): {w['ratio']:.2f} at {w['label']} "
                     f"(xaccel {ms['xaccel']:.3f} ms, eager {ms['eager']:.3f}, inductor {_f(ms.get('inductor'))}; "
                     f"{len(timed)} timed rows)")
    else:
        lines.append("worst xaccel / min(eager, inductor, where right): no row was timed")
    return lines


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m torch_xaccel.bench sweep",
                                description="eager vs Inductor default vs xaccel default over model forms x sizes x "
                                            "dtypes x modes, each row in its own process")
    p.add_argument("--quick", action="store_true", help="a small set of rows (~10 min of an H100, cold)")
    p.add_argument("--only", default="", help="only the rows whose label contains this text ('a|b': either)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="writes DIR/sweep.md, sweep.jsonl, sweep.log")
    p.add_argument("--list", action="store_true", help="print the rows and exit")
    p.add_argument("--modes", default="fwd,train", help="comma-separated: fwd, train")
    p.add_argument("--cpu", action="store_true", help="CPU rows (tiny sizes); also without a CUDA GPU")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--precision", choices=("highest", "high"), default="highest",
                   help="high: torch.set_float32_matmul_precision('high') in every row (TF32)")
    p.add_argument("--row-timeout", type=float, default=300.0, help="seconds per row (default 300)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set a variable in every row process (e.g. XACCEL_FALLBACK=inductor); repeatable")
    p.add_argument("--warm-caches", action="store_true",
                   help="keep the environment's Inductor, Triton and xaccel caches (faster reruns; first calls "
                        "then are not cold). Default: each row starts with empty caches, each compiled variant "
                        "its own Inductor and Triton ones")
    p.add_argument("--time-budget", type=float, default=1.5, help="seconds of timed rounds per row (default 1.5)")
    p.add_argument("--min-rounds", type=int, default=7)
    p.add_argument("--row", help=argparse.SUPPRESS)  # internal: run this one row (JSON) here
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def select(args) -> tuple[list, str]:
    # --list shows the GPU grid also where no GPU is (--cpu for the CPU rows)
    cpu = args.cpu or args.device == "cpu" or (args.device is None and not args.list and not torch.cuda.is_available())
    device = "cpu" if cpu else "cuda"
    modes = {m.strip() for m in args.modes.split(",") if m.strip()}
    unknown = modes - {"fwd", "train"}
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; allowed: fwd, train")
    wanted = args.only.split("|")
    rows = [r for r in forms.grid(args.quick, cpu) if r["mode"] in modes and any(w in forms.label(r) for w in wanted)]
    for r in rows:
        r.update(device=device, precision=args.precision, time_budget_s=args.time_budget, min_rounds=args.min_rounds,
                 cold=not args.warm_caches)
    return rows, device


def main(argv=None) -> int:
    args = parse(argv)
    if args.row:
        return _child(args)
    rows, device = select(args)
    if args.list:
        for n, r in enumerate(rows, 1):
            print(f"{n:4d}  {forms.label(r)}")
        print(f"{len(rows)} rows ({device}{', --quick' if args.quick else ''})")
        return 0
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA GPU here (--cpu runs the CPU rows)")
        return 2
    if not rows:
        print(f"no row matches --only {args.only!r} --modes {args.modes}; `--list` prints them")
        return 2
    extra = {}
    for kv in args.env:
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"--env {kv!r}: expected KEY=VALUE")
        extra[key] = value
    env, dropped = row_env(extra)
    _stop_on_sigterm()
    commit = (os.environ.get("XACCEL_COMMIT") or os.popen(f"git -C {_repo_root()} rev-parse --short HEAD 2>/dev/null")
              .read().strip() or "unknown")
    os.makedirs(args.out, exist_ok=True)
    md_path, jsonl_path, log_path = (os.path.join(args.out, f) for f in ("sweep.md", "sweep.jsonl", "sweep.log"))
    open(log_path, "w").close()
    settings = (f"fp32 matmul precision {args.precision}; rows in their own processes, interleaved rounds, medians; "
                f"{'caches as found' if args.warm_caches else 'cold caches (first calls compile from nothing)'}; "
                f"XACCEL_* in rows: {', '.join(f'{k}={v}' for k, v in extra.items()) or 'none (defaults)'}")
    if dropped:
        settings += f"; dropped from the environment: {', '.join(dropped)}"
    print(f"sweep: {len(rows)} rows on {device}, commit {commit}, torch {torch.__version__}; {settings}", flush=True)
    results, interrupted = [], False
    header = f"sweep: {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, commit {commit}; {settings}"
    with open(jsonl_path, "w") as jsonl:
        for n, row in enumerate(rows, 1):
            try:
                res = run_subprocess(row, args.row_timeout, env, log_path)
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the row's processes are ended; report what ran
                print(f"interrupted in row {n} of {len(rows)} ({forms.label(row)})", flush=True)
                interrupted = True
                break
            results.append(res)
            jsonl.write(json.dumps(res, default=str) + "\n")
            jsonl.flush()
            c = table_row(res)
            print(f"[{n}/{len(rows)}] {res['label']}: eager {c['eager ms']} inductor {c['inductor ms']} xaccel "
                  f"{c['xaccel ms']} ms, xaccel/min {c['xaccel/min']}, first call s {c['first s (ind, xac)']}, "
                  f"replaced {c['replaced']}, err {c['err']}, {res.get('status')} ({res['row_wall_s']}s)", flush=True)
            gpu = next((r["gpu"] for r in results if r.get("gpu")), "CPU" if device == "cpu" else "GPU ?")
            header = (f"sweep: {time.strftime('%Y-%m-%d')}, {gpu}, torch {torch.__version__}, commit {commit}; "
                      f"{settings}")
            with open(md_path, "w") as fh:  # rewritten after each row: an interrupted sweep keeps its table
                fh.write(markdown(results, header) + "\n" + "\n".join(summary(results)) + "\n")
    print("\n" + markdown(results, header))
    for line in summary(results):
        print(line)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
