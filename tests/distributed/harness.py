"""Two processes on the CPU with the gloo backend, for the DDP and FSDP2 tests.

The model is issue 59's: three blocks, each a pre-norm paper-style mLSTM and SwiGLU block
(torch_xaccel.sweep.forms) followed by a GEMM chain, d=128 (3.7 MB of fp32 parameters: four DDP
buckets of 1 MB). `reference()` runs one training step over the global batch in this process;
`spawn(scenario)` runs a scenario of this module on two ranks (torch.multiprocessing, spawned,
rendezvous through a file) and returns each rank's result. Each rank takes its half of the global
batch, so DDP's averaged gradients of the per-rank mean losses are the gradients of the global
mean loss.

What a step ran is counted two ways: the report's replacements (per compiled graph, as
torch_xaccel.last_report() gives them) and the xaccel op calls during the step (a counting kernel
provider that declines every call, so the references still run): graphs of the same code reused
for several blocks (FSDP2's per-unit graphs) count once in the first and once per block in the
second.
"""
from __future__ import annotations

import collections
import contextlib
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

import torch_xaccel
from torch_xaccel import distributed as xdist, families, runtime
from torch_xaccel.sweep.forms import GemmChain, MLSTMPaper, PreNormBlock, Stack

D, NH, S, B = 128, 2, 16, 2  # B: sequences per rank
WORLD = 2
BUCKET_MB = 1  # DDP's smallest bucket (its first bucket is 1 MB)
TIMEOUT_S = 240


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = PreNormBlock(D, MLSTMPaper(D, NH, fp32_rec=True))  # bf16: the recurrence in fp32
        self.chain = GemmChain(D, layers=1)

    def forward(self, x):
        return self.chain(self.pre(x))


def model(seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack([Block() for _ in range(3)])


def batch(step: int = 0, world: int = WORLD) -> torch.Tensor:
    """The global batch of a step: world * B sequences."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(world * B, S, D, generator=g)


def shard(x: torch.Tensor, rank: int, world: int = WORLD) -> torch.Tensor:
    return x.chunk(world)[rank]


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


@contextlib.contextmanager
def counting_ops():
    """Counts the xaccel op calls (forward and backward ops) while it is open."""
    calls = collections.Counter()

    def counter(op):
        def provider(_key, *_args):
            calls[op] += 1
            return NotImplemented
        return provider

    registered = [(op, counter(op)) for f in families.FAMILIES for op in (f.providers or {})]
    for op, p in registered:
        runtime.register_provider(op, p)
    try:
        yield calls
    finally:
        for op, p in registered:
            runtime.unregister_provider(op, p)


def unavailable() -> str:
    """Why these tests cannot run here, or ''."""
    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with the gloo backend is not in this torch build"
    return ""


def _full(t: torch.Tensor) -> torch.Tensor:
    """A gradient as one tensor (an FSDP2 DTensor shard gathered)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def train_step(run, params: nn.Module, x: torch.Tensor) -> dict:
    """One step's gradients, the report and the op calls of `run(x)` (no optimizer)."""
    for p in params.parameters():
        p.grad = None
    with counting_ops() as calls:
        loss = loss_of(run(x))
        loss.backward()
    report = torch_xaccel.last_report()
    return dict(loss=loss.item(), grads={n: _full(p.grad) for n, p in params.named_parameters()},
                counts=report.counts(), graphs=len(report.graphs), calls=dict(calls), report=str(report))


def reference() -> dict:
    """One process: the whole model compiled, one step over the global batch; and the report
    of the same model compiled per block (the graphs FSDP2 gives)."""
    torch._dynamo.reset()
    m = model()
    whole = train_step(torch.compile(m, backend="xaccel"), m, batch())
    torch._dynamo.reset()
    m = model()
    for blk in m.blocks:
        blk.compile(backend="xaccel")
    per_block = train_step(m, m, batch())
    torch._dynamo.reset()
    return dict(whole=whole, per_block=per_block)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def resumed_differences(checkpoint: dict, tol: float = 1e-6) -> dict:
    """What `_checkpoint_round_trip` found: {} where the resumed run's step-1 loss and parameters
    are the uninterrupted run's (and loading changed the parameters), else what differs."""
    (loss_a, params_a), (loss_b, params_b) = checkpoint["uninterrupted"], checkpoint["resumed"]
    bad = {n: rel_err(params_b[n], p) for n, p in params_a.items() if rel_err(params_b[n], p) > tol}
    if not torch.allclose(loss_a, loss_b, rtol=tol):
        bad["loss"] = (loss_a.item(), loss_b.item())
    if not any(rel_err(checkpoint["before_load"][n], p) > 1e-3 for n, p in params_a.items()):
        bad["load"] = "the other model's weights equal the checkpoint's before loading: nothing was checked"
    return bad


# --- two ranks ------------------------------------------------------------------------------------

def _worker(rank: int, world: int, store: str, scenario: str, out_dir: str, kwargs: dict) -> None:
    torch.set_num_threads(1)  # two ranks on a shared two-core machine
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = globals()[scenario](rank, world, out_dir=out_dir, **kwargs)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def spawn(scenario: str, world: int = WORLD, timeout: float = TIMEOUT_S, **kwargs) -> list:
    """Run `scenario(rank, world, out_dir=..., **kwargs)` on `world` spawned ranks; each rank's
    return value, in rank order. Raises with the failing rank's traceback, or after `timeout`
    seconds (the ranks are terminated)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="xaccel-dist-") as out_dir:
        store = os.path.join(out_dir, "store")
        ctx = mp.start_processes(_worker, args=(world, store, scenario, out_dir, kwargs), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{scenario}: the ranks ran past {timeout:.0f} s")
        except BaseException as e:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()  # (our own children, by handle)
            errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.endswith(".err")]
            raise RuntimeError(f"{scenario} failed: {e}\n" + "\n".join(errors)) from None
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _fresh():
    torch._dynamo.reset()


# --- DDP ------------------------------------------------------------------------------------------

def _ddp(m: nn.Module):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(m, bucket_cap_mb=BUCKET_MB)


def ddp_scenarios(rank: int, world: int, out_dir: str) -> dict:
    """torch's default (the DDP optimizer's splits), then whole graphs (keep_graphs_whole) with
    DDP around the module compiled, and with the module compiled inside DDP; then a checkpoint
    round trip."""
    from torch_xaccel.backend import xaccel_backend

    x = shard(batch(), rank, world)
    out = {"optimize_ddp_after_load": torch._dynamo.config.optimize_ddp}  # (the backend loaded, nothing set)

    # 1. the issue's run: optimize_ddp at torch's default, the split pieces' notes beside
    _fresh()
    previous = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = True
    notes = []

    def noting(gm, example_inputs, **kw):
        notes.append(xdist.split_note(gm))
        return xaccel_backend(gm, example_inputs, **kw)

    try:
        m = model()
        out["split"] = train_step(torch.compile(_ddp(m), backend=noting), m, x)
        out["split"]["notes"] = notes
        _fresh()  # the same through backend="xaccel": what its report says
        m = model()
        out["split_xaccel"] = train_step(torch.compile(_ddp(m), backend="xaccel"), m, x)
    finally:
        torch._dynamo.config.optimize_ddp = previous

    # 2. whole graphs
    xdist.keep_graphs_whole()
    _fresh()
    m = model()
    out["ddp_then_compile"] = train_step(torch.compile(_ddp(m), backend="xaccel"), m, x)
    _fresh()
    m = model()
    m.compile(backend="xaccel")
    out["compile_then_ddp"] = train_step(_ddp(m), m, x)

    # 3. checkpoint: torch.distributed.checkpoint of the compiled DDP model and its optimizer
    _fresh()
    out["checkpoint"] = _checkpoint_round_trip(rank, world, out_dir, lambda m: torch.compile(_ddp(m), backend="xaccel"))
    return out


# --- checkpoints ----------------------------------------------------------------------------------

def _checkpoint_round_trip(rank: int, world: int, out_dir: str, wrap, seed_other: int = 7) -> dict:
    """Train step 0, save (dcp) the model and AdamW state, train step 1: the uninterrupted run.
    Then a model of other weights, wrapped the same way, loads the checkpoint and trains step 1:
    the resumed run. Returns both runs' step-1 losses and parameters (full tensors), and the
    checkpoint's keys."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = os.path.join(out_dir, "checkpoint")

    def make(seed):
        m = model(seed)
        run = wrap(m)
        return m, run, torch.optim.AdamW(m.parameters(), lr=1e-2)

    def step(m, run, opt, i):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(run(shard(batch(i), rank, world)))
        loss.backward()
        opt.step()
        return loss.detach()

    def state(m):
        return {n: _full(p) for n, p in m.named_parameters()}

    m, run, opt = make(0)
    step(m, run, opt, 0)
    msd, osd = get_state_dict(run, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    keys = sorted(msd)
    uninterrupted = step(m, run, opt, 1), state(m)

    m2, run2, opt2 = make(seed_other)
    before = state(m2)
    msd2, osd2 = get_state_dict(run2, opt2)
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(run2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    resumed = step(m2, run2, opt2, 1), state(m2)
    return dict(keys=keys, uninterrupted=uninterrupted, resumed=resumed, before_load=before)


# --- FSDP2 ----------------------------------------------------------------------------------------

def _fully_shard():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6 kept it under _composable
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def sharded(m: nn.Module, compile_blocks: bool, policy=None) -> nn.Module:
    """fully_shard per block and on the root (each block compiled first, if asked)."""
    fully_shard, _ = _fully_shard()
    kw = {"mp_policy": policy} if policy is not None else {}
    for blk in m.blocks:
        if compile_blocks:
            blk.compile(backend="xaccel")
        fully_shard(blk, **kw)
    fully_shard(m, **kw)
    return m


def fsdp_scenarios(rank: int, world: int, out_dir: str) -> dict:
    """fully_shard per block and on the root, compiled per block and whole (fp32); the same
    with bf16 parameters and fp32 gradient reduction, compiled and not; a checkpoint round trip."""
    _, MixedPrecisionPolicy = _fully_shard()
    x = shard(batch(), rank, world)
    out = {}
    _fresh()
    m = sharded(model(), compile_blocks=True)
    out["per_block"] = train_step(m, m, x)
    _fresh()
    m = sharded(model(), compile_blocks=False)
    out["whole"] = train_step(torch.compile(m, backend="xaccel"), m, x)

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _fresh()
    m = sharded(model(), compile_blocks=True, policy=bf16)
    out["bf16"] = train_step(m, m, x)
    out["bf16"]["grad_dtypes"] = sorted({str(p.grad.dtype) for p in m.parameters()})
    m = sharded(model(), compile_blocks=False, policy=bf16)
    out["bf16_uncompiled"] = train_step(m, m, x)

    _fresh()
    out["checkpoint"] = _checkpoint_round_trip(
        rank, world, out_dir, lambda m: torch.compile(sharded(m, compile_blocks=False), backend="xaccel"))
    return out
