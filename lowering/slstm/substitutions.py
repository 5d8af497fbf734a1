"""Library sLSTM functions that Dynamo traces as one xaccel op instead of their own loops.

SUBSTITUTIONS lists them:
- the xlstm 2.0.6 package's vanilla backend: `slstm_forward` (sLSTMCell_vanilla._impl, so the
  cell's and sLSTMLayer's forward, and sLSTMLayer.step, which runs the cell's forward on one
  token) and `slstm_forward_step` (sLSTMCell.step). Its pointwise function branches on
  `if torch.all(n == 0.0)`: Dynamo breaks the graph there at every step and never sees the loop.
  Variant: fresh="batch", clamp_gates=True, clamp_n=False.
- FlashRNN 1.0.8's `vanilla` backend (`flashrnn_forward`, a loop over `Wx.unbind(0)` that Dynamo
  unrolls) and `vanilla_fwbw` (`forward_sequence`, a `range(T)` loop, and `slstm_pt_fwbw`, that
  loop in an autograd.Function with a hand-written backward). Variant: fresh="batch",
  clamp_gates=False, clamp_n=True.
A call of one step traces as xaccel::slstm_step (a decode step), a longer one as xaccel::slstm.
Eager calls are untouched.

Why these functions and not the modules' methods: `substitute_in_graph` takes functions, and
Dynamo never consults it for a method it inlines (`sLSTMCell_vanilla._impl` or the cell's
`forward` registered so are inlined as written). So a replacement keeps the library function's
contract, which includes values the op does not return: every step's c, n and m (xlstm's
`states_all`, all of FlashRNN's states) and xlstm's gates. Nothing is made up for them: h comes
from the op, the initial and final states from its inputs and outputs, and the states between
(and the gates) are recomputed from the op's h by a scan over the steps (`_history`: the
reference's step as one traced body, so a T=256 trace holds one op and one scan, not a loop).
After lowering, `drop_unread_history` finds where the code after the call reads none of the
recomputed values (sLSTMCell reads `states_all[0][1:]` and `states_all[:, -1]`; FlashRNN users
mostly `states[0]`) and removes the scan: then the op runs alone. Where something reads them the
scan stays, and the report says so (with XACCEL_FALLBACK=inductor such a graph runs as captured:
Inductor does not compile this scan).

Checked at trace time, else the library's own code is traced as before, graph breaks included:
the pointwise function is the library's sLSTM one (not the "lstm" registry entry), `constants` is
empty, the shapes are the sLSTM's (4 states, 4 gates), input, states, R and b share one floating
dtype, and no autocast is active. Outputs keep the library's dtypes (states and outputs in the
input dtype; the op's state math runs in fp32 where the library's runs in the input dtype).

Gradients (a trace-time refusal cannot become a report entry, as no graph exists yet, so they
are said here):
- vanilla_fwbw's `slstm_pt_fwbw` is substituted only where no input requires grad under grad
  mode: its hand-written backward holds m constant (no gradient into m0, others differ where a
  loss reads c, n or m), while xaccel::slstm differentiates through m as autograd does.
  `forward_sequence` (plain autograd through its loop, as ours) is substituted with gradients too,
  when not asked for the gates its autograd.Function saves.
- FlashRNN clamps n by torch.maximum(n', 1), whose gradient splits in half where n' is exactly 1
  (every fresh step from n = 0); the op's clamp_n is defined the same way, so an initial state's
  gradient agrees too.

Registered as the slstm family's trace hooks (families.py) when torch_xaccel.backend loads, and
right after a library module is imported later (a meta-path hook; the import is never forced).
XACCEL_DISABLE=1, or an XACCEL_PATTERNS without `slstm` (sequences) or `slstm_step` (one step),
read while tracing, trace the library's code. `report` lists each substituted call; it runs in
the slstm pass, and may run in any other (it reports a node once).
"""
from __future__ import annotations

import operator
import types
from collections import deque

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from torch_xaccel import config
from torch_xaccel.ops.slstm import reference
from torch_xaccel.report import Replacement

from .. import library_hooks
from ..graph_utils import frames, location, mutated_nodes, refake_downstream, val

_REGISTERED: set = set()
_LIBRARY: dict = {}  # function name -> the library's own function, under a new identity (not substituted)
_POINTWISE: dict = {}  # library -> its sLSTM pointwise function

XLSTM = ("batch", True, False)  # (fresh, clamp_gates, clamp_n)
FLASHRNN = ("batch", False, True)


def traced_here(node) -> bool:
    """Whether an FX node was traced from this file (a substituted library call), by its stack trace."""
    return __file__ in (node.meta.get("stack_trace") or "")


def _pattern_enabled(name: str) -> bool:
    try:
        cfg = config.current()
    except Exception:  # noqa: BLE001 - an invalid switch is reported by the backend itself
        return False
    return not cfg.disable and name in cfg.patterns


# Read at trace time and baked into the graph (a config change needs a recompile, like every
# other switch).
@torch._dynamo.assume_constant_result
def _sequence_enabled() -> bool:
    return _pattern_enabled("slstm")


@torch._dynamo.assume_constant_result
def _step_enabled() -> bool:
    return _pattern_enabled("slstm_step")


def _enabled(steps) -> bool:
    return _step_enabled() if steps == 1 else _sequence_enabled()


def _same_float_dtype(*tensors) -> bool:
    dtype = tensors[0].dtype
    return dtype.is_floating_point and all(t.dtype == dtype for t in tensors)


def _autocast(t) -> bool:
    return torch.is_autocast_enabled(t.device.type)


# ---- the op call and what the libraries return besides h -------------------------------------

def _run(Wx, R, b, h0, c0, n0, m0, variant):
    """Wx [B, S, 4, NH, D] (any strides), R [NH, 4, D, D], b [4, NH, D], states [B, NH, D] ->
    (h [S, B, NH, D] in Wx's dtype, final (h, c, n, m) in the compute dtype)."""
    if Wx.shape[1] == 1:
        final = torch.ops.xaccel.slstm_step(Wx[:, 0], R, b, h0, c0, n0, m0, *variant)
        return final[0].to(Wx.dtype)[None], final
    y, *final = torch.ops.xaccel.slstm(Wx, R, b, h0, c0, n0, m0, *variant)
    return y.transpose(0, 1), final


def _history(Wx, R, b, h_prev, c0, n0, m0, variant):
    """c, n, m [L, B, NH, D] after each of the first L steps, recomputed from the h that entered
    each step (h_prev [L, B, NH, D]); Wx [L, B, 4, NH, D]. One scan, so the trace holds one body
    whatever L is; drop_unread_history removes it where nothing reads its values."""
    from torch._higher_order_ops.scan import scan

    def body(carry, xs):
        wx, h = xs
        _, c, n, m = reference.step(wx, R, b, h, *carry, *variant)
        return (c, n, m), (c.clone(), n.clone(), m.clone())

    cd = reference.compute_dtype(Wx)
    R, b = R.clone(), b.clone()  # scan's operands may not alias one another (views of one state tensor)
    return scan(body, tuple(s.to(cd).clone() for s in (c0, n0, m0)), (Wx.clone(), h_prev.clone()))[1]


def _states_of_every_step(Wx, R, b, states0, variant):
    """(h, c, n, m) after every step [S, B, NH, D] each (h in Wx's dtype, c, n, m in the compute
    dtype), and the final states; Wx [S, B, 4, NH, D], states0 (h0, c0, n0, m0) [B, NH, D]."""
    h, final = _run(Wx.transpose(0, 1), R, b, *states0, variant)
    S = Wx.shape[0]
    if S == 1:
        return (h, *(s[None] for s in final[1:])), final
    h_prev = torch.cat([states0[0][None].to(Wx.dtype), h[:S - 1]], 0)
    c, n, m = _history(Wx[:S - 1], R, b, h_prev[:S - 1], *states0[1:], variant)
    return (h, *(torch.cat([s, f[None]], 0) for s, f in zip((c, n, m), final[1:]))), final


def _gates(Wx, R, b, h_prev, m_prev, m, clamp_gates):
    """xlstm's per-step gates (exp input gate, exp forget gate, z pre-activation, sigmoid output
    gate) [S, 4, B, NH, D] from the h and m entering and the m leaving each step."""
    cd = reference.compute_dtype(Wx)
    raw = Wx.to(cd) + torch.einsum("sbhk,hgjk->sbghj", h_prev.to(cd), R.to(cd)) + b.to(cd)
    i, f, z, o = raw.unbind(2)
    i_gate, f_gate = torch.exp(i - m), torch.exp(F.logsigmoid(f) + m_prev.to(cd) - m)
    if clamp_gates:  # torch.minimum as the library's (its gradient splits at ties)
        one = torch.ones_like(i_gate)
        i_gate, f_gate = torch.minimum(i_gate, one), torch.minimum(f_gate, one)
    return torch.stack([i_gate, f_gate, z, torch.sigmoid(o)], 1)


# ---- the xlstm package (xlstm.blocks.slstm.src.vanilla) --------------------------------------

def _xlstm_takes(x, states, R, b, pointwise_forward, constants) -> bool:
    if pointwise_forward is not _POINTWISE.get("xlstm") or constants or x.dim() != 3 or R.dim() != 3:
        return False
    S, B, G = x.shape
    NH, GD, D = R.shape
    H = NH * D
    return (S >= 1 and GD == 4 * D and G == 4 * H and tuple(states.shape) == (4, B, H) and tuple(b.shape) == (4 * H,)
            and _same_float_dtype(x, states, R, b) and not _autocast(x))


def _xlstm_layouts(x, states, R, b):
    """x [S, B, 4*H] gate-major ("SBGNH"), R [NH, 4*D, D] with R[h, g*D+j, k], b [4*H] in (g, h, d)
    order, states [4, B, H] -> the op's layouts, as views."""
    S, B, _ = x.shape
    NH, _, D = R.shape
    return (x.view(S, B, 4, NH, D), R.view(NH, 4, D, D), b.view(4, NH, D),
            tuple(s.view(B, NH, D) for s in states.unbind(0)))


def xlstm_sequence_as_xaccel(x, states, R, b, pointwise_forward, constants={}):  # noqa: B006 - the library's signature
    """xlstm's slstm_forward: (states_all [4, S+1, B, H], the final states [4, B, H], the gates
    [S+1, 4, B, H], their last row zero), all in the input dtype."""
    if not (_xlstm_takes(x, states, R, b, pointwise_forward, constants) and _enabled(x.shape[0])):
        return _LIBRARY["slstm_forward"](x, states, R, b, pointwise_forward, constants=constants)
    S, B, _ = x.shape
    Wx, R4, b3, states0 = _xlstm_layouts(x, states, R, b)
    every, final = _states_of_every_step(Wx, R4, b3, states0, XLSTM)
    states_all = torch.stack([torch.cat([s0.view(1, B, -1), s.to(x.dtype).reshape(S, B, -1)], 0)
                              for s0, s in zip(states.unbind(0), every)], 0)
    h_prev = torch.cat([states0[0][None], every[0][:S - 1]], 0)
    m_prev = torch.cat([states0[3][None].to(every[3].dtype), every[3][:S - 1]], 0)
    gates = _gates(Wx, R4, b3, h_prev, m_prev, every[3], XLSTM[1]).to(x.dtype).reshape(S, 4, B, -1)
    gates = torch.cat([gates, gates.new_zeros(1, *gates.shape[1:])], 0)
    return states_all, torch.stack(final, 0).to(states.dtype).view(4, B, -1), gates


def xlstm_step_as_xaccel(x, states, R, b, pointwise_forward, constants={}):  # noqa: B006 - the library's signature
    """xlstm's slstm_forward_step: the states after one step from x[0], [4, 1, B, H] in the
    states' dtype, and the library's gate buffer, which it never fills: zeros [S+1, 1, 4, B, H]."""
    if not (_xlstm_takes(x, states, R, b, pointwise_forward, constants) and _step_enabled()):
        return _LIBRARY["slstm_forward_step"](x, states, R, b, pointwise_forward, constants=constants)
    S, B, _ = x.shape
    Wx, R4, b3, states0 = _xlstm_layouts(x[:1], states, R, b)
    final = torch.ops.xaccel.slstm_step(Wx[0], R4, b3, *states0, *XLSTM)
    gates = x.new_zeros(S + 1, 1, 4, B, states.shape[2])
    return torch.stack(final, 0).to(states.dtype).view(4, 1, B, -1), gates


# ---- FlashRNN (flashrnn.flashrnn.vanilla, flashrnn.flashrnn.vanilla_fwbw) ---------------------

def _flashrnn_takes(Wx, states, R, b) -> bool:
    """Wx [.., 4, NH, D], states [4, B, NH, D] in either backend's order, b [4, NH, D], one dtype."""
    return (Wx.dim() == 5 and tuple(Wx.shape[2:]) == tuple(b.shape) and Wx.shape[2] == 4 and R.dim() == 4
            and _same_float_dtype(Wx, states, R, b) and not _autocast(Wx))


def flashrnn_vanilla_as_xaccel(Wx, states, R, b, pointwise_forward, constants={}):  # noqa: B006 - the library's signature
    """FlashRNN's vanilla flashrnn_forward: Wx [T, B, 4, NH, D], states [1, B, 4, NH, D] (the first
    used), R [NH, D_in, 4, D_out], b [4, NH, D] -> (every step's states [T, B, 4, NH, D], the last
    [1, B, 4, NH, D])."""
    T, B, _, NH, D = Wx.shape if Wx.dim() == 5 else (0,) * 5
    if not (pointwise_forward is _POINTWISE.get("flashrnn") and not constants and T >= 1
            and _flashrnn_takes(Wx, states, R, b) and tuple(states.shape[1:]) == (B, 4, NH, D)
            and tuple(R.shape) == (NH, D, 4, D) and _enabled(T)):
        return _LIBRARY["flashrnn_forward"](Wx, states, R, b, pointwise_forward, constants=constants)
    every, final = _states_of_every_step(Wx, R.permute(0, 2, 3, 1), b, tuple(states[0].unbind(1)), FLASHRNN)
    return torch.stack([s.to(Wx.dtype) for s in every], 2), torch.stack(final, 1).to(Wx.dtype)[None]


def _fwbw_sequence(states_initial, Wx, R, b):
    """forward_sequence's sLSTM without its gates: states_initial (4, B, NH, D) or (1, 4, B, NH,
    D), Wx (B, T, 4, NH, D), R (4, NH, D_out, D_in), b (4, NH, D) -> (every step's states (T, 4,
    B, NH, D), the last in states_initial's rank), in Wx's dtype."""
    s0 = states_initial[0] if states_initial.dim() == 5 else states_initial
    every, final = _states_of_every_step(Wx.transpose(0, 1), R.transpose(0, 1), b, tuple(s0.unbind(0)), FLASHRNN)
    last = torch.stack(final, 0).to(Wx.dtype)
    return torch.stack([s.to(Wx.dtype) for s in every], 1), last[None] if states_initial.dim() == 5 else last


def _fwbw_takes(states_initial, Wx, R, b) -> bool:
    if Wx.dim() != 5 or states_initial.dim() not in (4, 5) or not _flashrnn_takes(Wx, states_initial, R, b):
        return False
    B, T, _, NH, D = Wx.shape
    s0 = states_initial.shape[1:] if states_initial.dim() == 5 else states_initial.shape
    return (T >= 1 and (states_initial.dim() == 4 or states_initial.shape[0] == 1) and tuple(s0) == (4, B, NH, D)
            and tuple(R.shape) == (4, NH, D, D) and _enabled(T))


def flashrnn_forward_sequence_as_xaccel(states_initial, Wx, R, b, forward_pointwise,
                                        output_gates_and_states_initial=False):
    """FlashRNN's vanilla_fwbw forward_sequence with the sLSTM pointwise function, not asked for
    its gates (the autograd.Function asks: its backward reads them)."""
    if (forward_pointwise is not _POINTWISE.get("flashrnn_fwbw") or output_gates_and_states_initial
            or not _fwbw_takes(states_initial, Wx, R, b)):
        return _LIBRARY["forward_sequence"](states_initial, Wx, R, b, forward_pointwise,
                                            output_gates_and_states_initial=output_gates_and_states_initial)
    return _fwbw_sequence(states_initial, Wx, R, b)


def flashrnn_fwbw_as_xaccel(states_initial, Wx, R, b, backward_recurrent_clip_val=None,
                            autocast_kernel_dtype="float32"):
    """FlashRNN's slstm_pt_fwbw where no gradient is taken (its backward holds m constant, ours
    does not): (every step's states (T, 4, B, NH, D), the last), in Wx's dtype. The clip value
    only reaches its backward; the kernel dtype only applies under CUDA autocast (refused)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (states_initial, Wx, R, b))
    if grad or autocast_kernel_dtype not in ("float32", "float16", "bfloat16") or not _fwbw_takes(
            states_initial, Wx, R, b):
        return _LIBRARY["slstm_pt_fwbw"](states_initial, Wx, R, b, backward_recurrent_clip_val,
                                         autocast_kernel_dtype=autocast_kernel_dtype)
    return _fwbw_sequence(states_initial, Wx, R, b)


# (module, function, traceable replacement)
SUBSTITUTIONS = (
    ("xlstm.blocks.slstm.src.vanilla", "slstm_forward", xlstm_sequence_as_xaccel),
    ("xlstm.blocks.slstm.src.vanilla", "slstm_forward_step", xlstm_step_as_xaccel),
    ("flashrnn.flashrnn.vanilla", "flashrnn_forward", flashrnn_vanilla_as_xaccel),
    ("flashrnn.flashrnn.vanilla_fwbw.fw", "forward_sequence", flashrnn_forward_sequence_as_xaccel),
    ("flashrnn.flashrnn.vanilla_fwbw.fwbw", "slstm_pt_fwbw", flashrnn_fwbw_as_xaccel),
)
# library -> (module, function): the sLSTM pointwise function a call must pass to be substituted
POINTWISE = {
    "xlstm": ("xlstm.blocks.slstm.src.vanilla.slstm", "slstm_forward_pointwise"),
    "flashrnn": ("flashrnn.flashrnn.vanilla.slstm", "flashrnn_forward_pointwise"),
    "flashrnn_fwbw": ("flashrnn.flashrnn.vanilla_fwbw.fw", "slstm_pointwise_fw"),
}
_MODULES = {mod for mod, _, _ in SUBSTITUTIONS} | {mod for mod, _ in POINTWISE.values()}
# the report's words for each replacement's function
_PATTERNS = {
    "xlstm_sequence_as_xaccel": "xlstm vanilla sLSTM",
    "xlstm_step_as_xaccel": "xlstm vanilla sLSTM step",
    "flashrnn_vanilla_as_xaccel": "FlashRNN vanilla sLSTM",
    "flashrnn_forward_sequence_as_xaccel": "FlashRNN vanilla_fwbw forward_sequence sLSTM",
    "flashrnn_fwbw_as_xaccel": "FlashRNN vanilla_fwbw sLSTM without gradients",
}


def register() -> None:
    """Install the handlers of the libraries already imported, and a hook for the others;
    idempotent."""
    library_hooks.register(_MODULES, _install)


def _unsubstituted(fn):
    """The same code under another function object: Dynamo inlines it as written (a call of `fn`
    itself would come back here)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__module__ = fn.__qualname__, fn.__module__
    return copy


def _install(module) -> None:
    for library, (mod, name) in POINTWISE.items():
        if module.__name__ == mod and hasattr(module, name):
            _POINTWISE[library] = getattr(module, name)
    for mod, name, replacement in SUBSTITUTIONS:
        fn = getattr(module, name, None) if module.__name__ == mod else None
        if fn is None or id(fn) in _REGISTERED:
            continue
        _LIBRARY[name] = _unsubstituted(fn)
        try:
            torch._dynamo.substitute_in_graph(fn, skip_signature_check=True)(replacement)
        except Exception:  # noqa: BLE001 - another handler already registered: the library's code is traced
            continue
        _REGISTERED.add(id(fn))


# ---- after lowering: the report, and the recomputed states nothing reads ---------------------

_OPS = {torch.ops.xaccel.slstm.default: ("slstm", "xaccel.slstm"),
        torch.ops.xaccel.slstm_step.default: ("slstm_step", "xaccel.slstm_step")}
_REPORTED = "xaccel_slstm_reported"


def report(gm: torch.fx.GraphModule, ctx) -> None:
    """Drop the recomputed states nothing reads (drop_unread_history), then list every op call
    traced from here as a replacement, once per node (whichever pass calls this first)."""
    fold_reads_of_assembled_states(gm)
    recomputing = {_call_of(scan) for scan in drop_unread_history(gm)}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _OPS or not traced_here(node) or node.meta.get(_REPORTED):
            continue
        node.meta[_REPORTED] = True
        family, op = _OPS[node.target]
        fn = next((f for _, _, f in reversed(frames(node)) if f in _PATTERNS), None)
        note = "every step's states are recomputed too (the code after it reads them)" if node in recomputing else ""
        ctx.report.replacements.append(Replacement(family, op, f"{_PATTERNS.get(fn, 'library sLSTM')} (substituted "
                                                   "while Dynamo traced)", location(node), note))


def fold_reads_of_assembled_states(gm: torch.fx.GraphModule) -> None:
    """The library's code reads h back out of the states_all the substitution assembles
    (states_all[0, 1:]): a select of a stack traced here, or a slice of a cat traced here, that
    takes exactly one of its parts (same dtype) reads that part instead. The stack and the cats (a
    copy of every step's h, c, n and m, and in training the zero-filled gradient buffers of their
    backward) then go with the rest that nothing reads. Nothing written in place is folded: the
    part is not a view of the buffer, as the select or slice was."""
    graph, written = gm.graph, None
    for node in list(graph.nodes):
        if node.op != "call_function" or node.kwargs:
            continue
        try:
            part = (_stacked_part(node) if node.target is torch.ops.aten.select.int else
                    _concatenated_part(node) if node.target is torch.ops.aten.slice.Tensor else None)
        except Exception:  # noqa: BLE001 - a form this fold does not understand stays as written
            part = None
        if part is None or not isinstance(val(part), torch.Tensor) or val(part).dtype != val(node).dtype:
            continue
        written = mutated_nodes(graph) if written is None else written
        if {node, node.args[0], part} & written:
            continue
        node.replace_all_uses_with(part)
        graph.erase_node(node)
        refake_downstream(part)


def _stacked_part(select: torch.fx.Node):
    """The stacked tensor a select of a stack traced here takes, else None."""
    src = _assembled_here(select.args[0], torch.ops.aten.stack.default)
    if src is None:
        return None
    rank, parts = val(src).dim(), src.args[0]
    index = _size_arg(select.args[2])
    if not isinstance(index, int) or _dim(select.args[1], rank) != _joined_dim(src):
        return None
    index = index + len(parts) if index < 0 else index
    return parts[index] if 0 <= index < len(parts) else None


def _concatenated_part(piece: torch.fx.Node):
    """The operand a slice of a cat traced here (along the cat's dim, step 1) covers exactly, else None."""
    src = _assembled_here(piece.args[0], torch.ops.aten.cat.default)
    if src is None:
        return None
    dim, start, end, step = (list(map(_size_arg, piece.args[1:])) + [0, None, None, 1][len(piece.args) - 1:])[:4]
    dim = _dim(dim, val(src).dim())
    if step != 1 or dim != _joined_dim(src):
        return None
    total, offset = val(src).shape[dim], 0
    for k, part in enumerate(src.args[0]):
        size = val(part).shape[dim] if isinstance(val(part), torch.Tensor) else None
        if size is None:
            return None
        last = k == len(src.args[0]) - 1
        ends = (end is not None and _known(end == offset + size)) or (
            last and (end is None or _known(end >= total)))
        if _known((start or 0) == offset) and ends:
            return part
        offset = offset + size
    return None


def _assembled_here(node, target):
    """node when it is a `target` (stack or cat) call traced here with a tensor value, else None."""
    if (isinstance(node, torch.fx.Node) and node.target is target and traced_here(node) and not node.kwargs
            and isinstance(val(node), torch.Tensor)):
        return node
    return None


def _joined_dim(node) -> int:
    """The dim a stack or cat node joins along, non-negative."""
    return _dim(node.args[1] if len(node.args) > 1 else 0, val(node).dim())


def _size_arg(a):
    """An int argument as the graph holds it: a symbolic size's node as its SymInt."""
    return val(a) if isinstance(a, torch.fx.Node) else a


def _call_of(scan_node):
    """The op call whose states a scan recomputes: the nearest one upstream through nodes traced
    here (its h enters the scan; another call's output reaches it only through the user's code)."""
    seen, todo = set(), deque(scan_node.all_input_nodes)
    while todo:
        node = todo.popleft()
        if node in seen or not traced_here(node):
            continue
        seen.add(node)
        if node.op == "call_function" and node.target in _OPS:
            return node
        todo.extend(node.all_input_nodes)
    return None


def drop_unread_history(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Remove each scan traced here whose values nothing reads; return the scans kept.

    A scan's outputs are followed through the graph as boxes (per dimension an index range that
    may hold a value derived from them, or the whole dimension): cat, stack, select, slice,
    unsqueeze, permute, transpose, unbind and casts move or cut the boxes exactly; a view that
    keeps the boxed leading dimensions keeps them; any other op spreads a box over its whole
    output. The values are read where a box reaches the graph's output or an op this walk does
    not follow (one writing in place, one with several outputs), or where anything that aliases
    them is written in place. Unread, the scan's outputs become zeros of their shape (never
    seen), and the scan and what only fed it go, as does the rest traced here that nothing uses
    (xlstm's gates, which the cell drops)."""
    graph = gm.graph
    scans = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.scan
             and traced_here(n)]
    written = mutated_nodes(graph) if scans else set()
    kept = []
    for scan_node in scans:
        outs = list(scan_node.users)
        if (not all(u.target is operator.getitem for u in outs) or _read(graph, outs, written)
                or not _zero(graph, scan_node, outs)):
            kept.append(scan_node)
    _erase_dead(graph, [n for n in graph.nodes if traced_here(n)])
    gm.recompile()
    return kept


def _zero(graph, scan_node, outs) -> bool:
    """Replace the scan's outputs by zeros shaped like one of its per-step inputs and erase it;
    False (nothing changed) where no input has an output's shape."""
    used = [o for o in outs if o.users]
    likes = [next((x for x in scan_node.args[2] if _same_sizes(val(x), val(o))), None) for o in used]
    if any(like is None for like in likes):
        return False
    for out, like in zip(used, likes):
        while like.target is torch.ops.aten.clone.default:  # the clone only fed the scan
            like = like.args[0]
        with graph.inserting_before(out):
            zeros = graph.call_function(torch.ops.aten.zeros_like.default, (like,), {"dtype": val(out).dtype})
        zeros.meta.update(out.meta)
        out.replace_all_uses_with(zeros)
    for out in outs:
        graph.erase_node(out)
    operands = scan_node.all_input_nodes
    graph.erase_node(scan_node)
    _erase_dead(graph, operands)
    for node in operands:
        if node.op == "get_attr" and not node.users:  # the scan's body
            graph.erase_node(node)
    return True


def _erase_dead(graph, nodes) -> None:
    """Erase those of `nodes` (and, after them, their inputs traced here) that nothing uses."""
    todo, erased = list(nodes), set()
    while todo:
        node = todo.pop()
        if node in erased or node.users or node.op != "call_function" or node.is_impure():
            continue
        inputs = [a for a in node.all_input_nodes if traced_here(a) or a.target is operator.getitem]
        graph.erase_node(node)
        erased.add(node)
        todo.extend(inputs)


def _same_sizes(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim()
            and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape)))


def _known(cond) -> bool:
    return statically_known_true(cond) if not isinstance(cond, bool) else cond


def _read(graph, outs, written) -> bool:
    """Whether any value of these scan outputs reaches the graph's output, an op the walk does
    not follow, or an alias written in place (see drop_unread_history); anything unexpected
    counts as reading."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    boxes: dict[torch.fx.Node, list] = {out: [(None,) * val(out).dim()] for out in outs}
    todo = sorted(outs, key=order.__getitem__)
    try:
        while todo:
            node = todo.pop(0)
            if node in written:
                return True
            for user in node.users:
                if user.op == "output":
                    if boxes.get(node):
                        return True
                    continue
                new = _move(user, node, boxes) if user.op == "call_function" else None
                if new is None or user in written:
                    return True
                if new:
                    boxes.setdefault(user, []).extend(new)
                if (new or _is_alias(user)) and user not in todo:  # a view holding none may still be written
                    todo.append(user)
                    todo.sort(key=order.__getitem__)
    except Exception:  # noqa: BLE001 - a graph this walk does not understand keeps its scan
        return True
    return False


def _is_alias(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


_METADATA = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
             torch.ops.aten.sym_storage_offset.default}  # read no values
_SHAPE_PRESERVING = {  # elementwise on one tensor: a value stays where it was
    torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default, torch.ops.aten.alias.default, torch.ops.aten.detach.default,
    torch.ops.aten.contiguous.default, torch.ops.aten.lift_fresh_copy.default,
}
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}


def _move(user, node, boxes):
    """The boxes of `user`'s output that may hold values from `node` (an input of it), [] for
    none, None where `user` itself counts as reading them (it writes in place, or returns
    something this walk does not follow)."""
    mine = boxes.get(node) or []
    target = user.target
    if not mine or target in _METADATA:
        return []
    if getattr(target, "_schema", None) is not None and target._schema.is_mutable:
        return None
    args = tuple(val(a) if isinstance(a, torch.fx.Node) and not isinstance(val(a), torch.Tensor) else a
                 for a in user.args)  # symbolic sizes as their SymInts
    if target is operator.getitem and node.target is torch.ops.aten.unbind.int:  # its k-th: a select
        src = val(node.args[0])
        return _select(mine, _dim(node.args[1] if len(node.args) > 1 else 0, src.dim()), args[1], src)
    if target is torch.ops.aten.unbind.int and not user.kwargs:
        return list(mine)  # each getitem cuts them
    out = val(user)
    if not isinstance(out, torch.Tensor):
        return None
    whole = [(None,) * out.dim()]
    if target in _SHAPE_PRESERVING:
        return list(mine) if args[0] is node else whole
    if user.kwargs:  # the structural ops below as traced take their arguments positionally
        return whole
    if target in (torch.ops.aten.cat.default, torch.ops.aten.stack.default):
        tensors, dim = args[0], _dim(args[1] if len(args) > 1 else 0, out.dim())
        if target is torch.ops.aten.stack.default:
            return [box[:dim] + ((k, k + 1),) + box[dim:] for k, t in enumerate(tensors) if t is node for box in mine]
        offset, moved = 0, []
        for t in tensors:
            size = val(t).shape[dim]
            if t is node:
                for box in mine:
                    lo, hi = box[dim] if box[dim] is not None else (0, size)
                    moved.append(box[:dim] + ((lo + offset, hi + offset),) + box[dim + 1:])
            offset = offset + size
        return moved
    if args[0] is not node:
        return whole  # the value enters another way (an operand of an elementwise op)
    src = val(node)
    if target is torch.ops.aten.select.int:
        return _select(mine, _dim(args[1], src.dim()), args[2], src)
    if target is torch.ops.aten.slice.Tensor:
        return _slice(mine, _dim(args[1] if len(args) > 1 else 0, src.dim()), args[2:], src)
    if target is torch.ops.aten.unsqueeze.default:
        dim = _dim(args[1], out.dim())
        return [box[:dim] + (None,) + box[dim:] for box in mine]
    if target is torch.ops.aten.permute.default:
        dims = [_dim(d, out.dim()) for d in args[1]]
        return [tuple(box[d] for d in dims) for box in mine]
    if target is torch.ops.aten.transpose.int:
        a, b = _dim(args[1], src.dim()), _dim(args[2], src.dim())
        return [tuple(box[b] if d == a else box[a] if d == b else box[d] for d in range(len(box))) for box in mine]
    if target in _VIEWS:  # row-major order: equal leading sizes keep their indices
        keep = 0
        while keep < min(src.dim(), out.dim()) and _known(src.shape[keep] == out.shape[keep]):
            keep += 1
        if all(all(d is None for d in box[keep:]) for box in mine):
            return [box[:keep] + (None,) * (out.dim() - keep) for box in mine]
    return whole


def _index(i, size):
    """i as a provably non-negative index (negatives counted from the end), else None."""
    if isinstance(i, int) and i < 0:
        i = i + size
    return i if _known(i >= 0) else None


def _select(mine, dim, idx, src):
    idx = _index(idx, src.shape[dim])
    if idx is None:
        return [box[:dim] + box[dim + 1:] for box in mine]
    return [box[:dim] + box[dim + 1:] for box in mine if not _outside(box[dim], idx, idx + 1)]


def _slice(mine, dim, bounds, src):
    size = src.shape[dim]
    start = bounds[0] if len(bounds) > 0 and bounds[0] is not None else 0
    end = bounds[1] if len(bounds) > 1 and bounds[1] is not None else size
    step = bounds[2] if len(bounds) > 2 else 1
    if isinstance(end, int) and end >= 2 ** 62:  # "to the end"
        end = size
    start, end = _index(start, size), _index(end, size)
    if start is None or end is None or not (isinstance(step, int) and step == 1):
        return [box[:dim] + (None,) + box[dim + 1:] for box in mine]  # anywhere along dim
    moved = []
    for box in mine:
        if _outside(box[dim], start, end):
            continue
        lo, hi = box[dim] if box[dim] is not None else (start, end)
        lo = lo - start if _known(lo >= start) else 0
        hi = hi - start if _known(hi <= end) else None
        moved.append(box[:dim] + ((lo, hi) if hi is not None else None,) + box[dim + 1:])
    return moved


def _dim(d, rank) -> int:
    return d + rank if d < 0 else d


def _outside(rng, lo, hi) -> bool:
    """Whether the range [lo, hi) provably misses rng (None: the whole dimension)."""
    if rng is None:
        return False
    a, b = rng
    return _known(hi <= a) or _known(lo >= b)
