"""xaccel::gemm_epilogue — one or two GEMMs sharing `a`, followed by an elementwise chain.

    out = epilogue(acc_0 = a @ op(b_0), acc_1 = a @ op(b_1), operands...)

where op(b) = b^T when `b_transposed` (an nn.Linear weight, N x K) and b otherwise (K x N), and
the GEMM follows torch.matmul's shape rules (a: [..., M, K]; b: 2-D, or 3-D batched with a 3-D a).
Two GEMMs express SwiGLU-style blocks: silu(a @ W1^T) * (a @ W3^T).

Reference semantics: each GEMM runs in the input dtype (as eager does, a bias or residual add right
after it inside it, as F.linear's addmm), the chain runs in fp32 on the accumulator and the result
is rounded once to the input dtype. In fp32 this is exactly eager.
Where tuning times ATen faster, the runtime runs aten_composition (the chain in eager's dtypes).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .epilogue_ir import evaluate, needed_by_vjp, node_function, parse, vjp


def b_kn(b: Tensor, b_transposed: bool) -> Tensor:
    return b.transpose(-1, -2) if b_transposed else b


def b_nk(b: Tensor, b_transposed: bool) -> Tensor:
    """op(b)^T without a transpose of a transpose (the backward graph's GEMM then reads b as it is)."""
    return b if b_transposed else b.transpose(-1, -2)


def forward(a: Tensor, bs: list[Tensor], operands: list[Tensor], epilogue: str, b_transposed: bool) -> list[Tensor]:
    """The op's semantics. A bias or residual add right after a GEMM runs inside it (torch.addmm,
    as F.linear adds its bias: one rounding, where a GEMM rounded to the input dtype and then
    added would round twice, and near-zero pre-activations would then flip a relu's mask)."""
    return _compose(a, bs, operands, epilogue, b_transposed, torch.float32, fold_adds=True)


def aten_composition(a: Tensor, bs: list[Tensor], operands: list[Tensor], epilogue: str,
                     b_transposed: bool) -> list[Tensor]:
    """cuBLAS GEMMs and the chain node by node in the input dtype, as the user's eager code ran it:
    what the runtime runs where tuning timed ATen faster than the kernel (the fp32-chain reference
    costs an extra fp32 pass per node). Equals the reference in fp32; in bf16/fp16 it differs only
    by intermediate rounding, as eager does."""
    if a.dtype == torch.float32:
        return forward(a, bs, operands, epilogue, b_transposed)
    # eager's dtypes (a 0-d fp32 scalar stays fp32), a bias or residual add folded into cuBLAS
    return _compose(a, bs, operands, epilogue, b_transposed, None, fold_adds=True)


def _addmm_folds(ep, a, bs, operands) -> dict[int, tuple[int, int, str]]:
    """GEMM index -> (add node, operand, its broadcast) where the accumulator's only reader is an
    add of a full or row operand of the input dtype: torch.addmm then adds it in cuBLAS's epilogue,
    as F.linear does with its bias (a separate add kernel costs a read and a write of the whole
    [M, N] output)."""
    readers: dict[int, list[int]] = {}
    for k, n in enumerate(ep.nodes):
        for j in n.get("in", ()):
            readers.setdefault(j, []).append(k)
    folds = {}
    for i, n in enumerate(ep.nodes):
        if n["op"] != "acc" or i in ep.outputs or len(readers.get(i, ())) != 1 or bs[n["index"]].dim() != 2:
            continue
        k = readers[i][0]
        add = ep.nodes[k]
        other = [j for j in add.get("in", ()) if j != i]
        if add["op"] != "add" or len(other) != 1 or ep.nodes[other[0]]["op"] != "load":
            continue
        load = ep.nodes[other[0]]
        if load["bcast"] in ("full", "row") and operands[load["operand"]].dtype == a.dtype:
            folds[n["index"]] = (k, load["operand"], load["bcast"])
    return folds


_PROGRAMS: dict = {}  # (epilogue, b_transposed, chain dtype, fold_adds, dtypes and dims) -> program


def _compose(a, bs, operands, epilogue, b_transposed, chain_dtype, fold_adds=False) -> list[Tensor]:
    """The GEMMs in the input dtype, the chain in chain_dtype (None: the operands' own dtypes),
    outputs rounded to the input dtype. fold_adds: a bias or residual add right after a GEMM runs
    inside it (torch.addmm: one rounding instead of two). Runs as straight-line Python generated
    once per form (_program): decode is host-bound and calls the ATen path many times a token, so
    walking the chain on each call would cost host time comparable to the ops themselves."""
    form = (epilogue, b_transposed, chain_dtype, fold_adds, a.dtype, *(b.dim() for b in bs),
            *(t.dtype for t in operands))
    program = _PROGRAMS.get(form)
    if program is None:
        if len(_PROGRAMS) >= 4096:
            _PROGRAMS.clear()
        program = _PROGRAMS[form] = _program(epilogue, a, bs, operands, b_transposed, chain_dtype, fold_adds)
    return program(a, bs, operands)


def _program(epilogue, a, bs, operands, b_transposed, chain_dtype, fold_adds):
    """(a, bs, operands) -> outputs for one form: each GEMM (or addmm with its folded add), each
    chain node in order (epilogue_ir.evaluate's functions and casts), each output rounded to a's
    dtype, contiguous, and cloned where it is an input (custom ops must not alias their inputs)."""
    ep = parse(epilogue)
    folds = _addmm_folds(ep, a, bs, operands) if fold_adds else {}
    env = {"torch": torch, "CHAIN": chain_dtype}
    cast = "" if chain_dtype is None else ".to(CHAIN)"
    lines = ["def program(a, bs, operands):"]
    folded = {}  # add node -> the GEMM whose addmm computes it
    for i in range(len(bs)):
        b = f"bs[{i}].transpose(-1, -2)" if b_transposed else f"bs[{i}]"
        if i not in folds:
            lines.append(f"    acc{i} = torch.matmul(a, {b})")
            continue
        node, j, bcast = folds[i]
        folded[node] = i
        bias = f"operands[{j}].flatten(0, -2)" if bcast == "full" else f"operands[{j}].reshape(n{i})"
        lines += [f"    n{i} = bs[{i}].shape[{0 if b_transposed else 1}]",
                  f"    v{node} = torch.addmm({bias}, a.flatten(0, -2), {b}).view(*a.shape[:-1], n{i}){cast}"]
    folded_accs = {k for k, n in enumerate(ep.nodes) if n["op"] == "acc" and n["index"] in folds}
    for k, n in enumerate(ep.nodes):
        op, ins = n["op"], ", ".join(f"v{j}" for j in n.get("in", ()))
        if k in folded or k in folded_accs:  # computed by addmm / read only by its folded add
            continue
        if op == "acc":
            lines.append(f"    v{k} = acc{n['index']}{cast}")
        elif op == "load":
            lines.append(f"    v{k} = operands[{n['operand']}]{cast}")
        elif op == "const":
            env[f"c{k}"] = n["value"]
            lines.append(f"    v{k} = c{k}")
        else:
            env[f"f{k}"] = node_function(op)
            lines.append(f"    v{k} = f{k}({ins})")
    outs = ", ".join(f"v{o}.to(a.dtype).contiguous()" for o in ep.outputs)
    lines += [f"    outs = [{outs}]",
              "    inputs = {id(a), *map(id, bs), *map(id, operands)}",
              "    return [o.clone() if id(o) in inputs else o for o in outs]"]
    exec(compile("\n".join(lines), f"<xaccel gemm_epilogue ATen program {len(_PROGRAMS)}>", "exec"), env)
    return env["program"]


def backward(grads, a, bs, operands, epilogue, b_transposed, saved=None):
    """Gradients of (a, bs, operands). Values the chain's reverse pass reads come from the
    forward's outputs when the lowering had it emit them (`saved`: node id -> tensor); whatever
    is missing is recomputed (the GEMMs only if an accumulator is needed). The reverse pass runs
    in the input dtype, as eager's does; then the GEMM transposes. Broadcast operands and batch
    dims are summed back to their shapes."""
    ep = parse(epilogue)
    saved = saved or {}
    need = needed_by_vjp(ep, set(saved))
    if any(ep.nodes[i]["op"] == "acc" for i in need):
        accs = [torch.matmul(a, b_kn(b, b_transposed)) for b in bs]
    else:
        accs = [None] * len(bs)
    dtype = a.dtype if a.dtype in (torch.float16, torch.bfloat16) else torch.float32
    vals = evaluate(ep, accs, operands, dtype=dtype, only=need, preset=saved)
    acc_grads, op_grads = vjp(ep, vals, grads, dtype)
    da = None
    dbs = []
    for k, b in enumerate(bs):
        g = acc_grads.get(k)
        if g is None:
            dbs.append(torch.zeros_like(b))
            continue
        g = g.to(a.dtype)
        part = torch.matmul(g, b_nk(b, b_transposed)).sum_to_size(a.shape)
        da = part if da is None else da + part
        if b.dim() == 2:  # fold all leading dims of a into M: one large GEMM
            a2, g2 = a.flatten(0, -2), g.flatten(0, -2)  # (not reshape(-1, K): ambiguous when K or N is 0)
            db = g2.t() @ a2 if b_transposed else a2.t() @ g2
        else:
            db = (g.transpose(-1, -2) @ a if b_transposed else a.transpose(-1, -2) @ g).sum_to_size(b.shape)
        dbs.append(db)
    if da is None:
        da = torch.zeros_like(a)
    dops = [op_grads[j].sum_to_size(t.shape).to(t.dtype) if j in op_grads else torch.zeros_like(t)
            for j, t in enumerate(operands)]
    return da, dbs, dops


