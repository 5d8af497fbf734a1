"""Real code: the xlstm 2.0.6 package's sLSTM on its vanilla backend (sLSTMLayer, an
xLSTMBlockStack mixing sLSTM and mLSTM blocks) compiles through the backend with its per-step loop
traced as one xaccel.slstm (lowering/slstm/substitutions.py), a one-step call as
xaccel.slstm_step, and equals eager in fp32, forward and every parameter's gradient within 1e-5
relative. Switched off, the library's own code runs. The library function's full results
(every step's states and gates) stay truthful where a caller reads them."""
import pytest
import torch

import torch_xaccel
from tests.helpers import rel_err
from torch_xaccel.backend import xaccel_backend
from torch_xaccel.report import Report, collect

pytest.importorskip("xlstm.blocks.slstm.layer")
from xlstm.blocks.slstm.layer import sLSTMLayer, sLSTMLayerConfig  # noqa: E402
from xlstm.blocks.slstm.src import vanilla as slstm_vanilla  # noqa: E402

TOL = 1e-5
PATTERN = "xlstm vanilla sLSTM (substituted while Dynamo traced)"


def _randomize(model, seed=0, prefix=""):
    """Fresh random weights (the package initialises R to zeros) for the parameters under
    `prefix`: recurrent blocks scaled by 1/sqrt(D), the rest unit-order, so gates neither
    saturate nor vanish."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(prefix):
                continue
            scale = p.shape[-1] ** -0.5 if "recurrent" in name else 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model


def _layer(E=32, NH=2, conv=4, seed=0):
    cfg = sLSTMLayerConfig(embedding_dim=E, num_heads=NH, conv1d_kernel_size=conv, backend="vanilla")
    return _randomize(sLSTMLayer(cfg), seed)


def _state(B, E, seed=1, n_zero=None):
    """A random (h, c, n, m) state [4, B, E] with n > 0; n_zero: rows whose n is 0."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(4, B, E, generator=gen)
    state[2] = state[2].abs() + 0.5
    if n_zero is not None:
        state[2, n_zero] = 0.0
    return state


def _loss(outs):
    """A fixed random cotangent per output: every output's gradient counts."""
    gen = torch.Generator().manual_seed(7)
    return sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _flat(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _flat(v)]
    return []


def _compare(model, fn, leaves=(), tol=TOL):
    """fn(model) eagerly and compiled: outputs and the gradients of every parameter and leaf
    within tol; returns the compile's report (every graph of it)."""
    params = [p for p in model.parameters()] + list(leaves)
    want = _flat(fn(model))
    want_grads = torch.autograd.grad(_loss(want), params, allow_unused=True)
    torch._dynamo.reset()
    with collect() as graphs:
        got = _flat(fn(torch.compile(model, backend="xaccel")))
    got_grads = torch.autograd.grad(_loss(got), params, allow_unused=True)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert rel_err(g, w) <= tol, rel_err(g, w)
    for (name, _), g, w in zip([*model.named_parameters(), *((f"leaf{i}", t) for i, t in enumerate(leaves))],
                               got_grads, want_grads):
        if w is None:
            assert g is None or not g.any(), name
            continue
        assert rel_err(g, w) <= tol, (name, rel_err(g, w))
    return Report(graphs=graphs)


@pytest.mark.parametrize("E, NH, conv, T", [(32, 2, 4, 7), (64, 4, 0, 9), (32, 4, 0, 1), (64, 2, 4, 33)])
def test_slstm_layer_substituted_equal_to_eager_in_forward_and_gradients(E, NH, conv, T):
    x = torch.randn(3, T, E)
    report = _compare(_layer(E, NH, conv), lambda m: m(x))
    family = "slstm_step" if T == 1 else "slstm"  # one step traces as the decode step
    assert report.counts()[family] == 1, str(report)
    ours = [r for r in report.replacements if r.family == family]
    assert ours[0].pattern == PATTERN
    assert ours[0].op == f"xaccel.{family}" and ours[0].location
    assert not ours[0].note, "the cell reads no recomputed state: the history scan is dropped"
    assert not report.graph_breaks, str(report)


def test_states_all_assembled_for_the_library_is_not_built_where_only_h_is_read(monkeypatch):
    """The layer reads h back out of the states_all buffer the substitution assembles
    (states_all[0, 1:]): that read takes the op's h directly, so the lowered graph stacks and
    concatenates no per-step states (a copy of every step's h, c, n, m, and in training the
    zero-filled gradient buffers of that copy). Forward and gradients equal to eager."""
    from torch_xaccel import lowering

    lowered, run_passes = [], lowering.run_passes

    def recording(gm, ctx):
        out = run_passes(gm, ctx)
        lowered.append({n.target for n in out.graph.nodes if n.op == "call_function"})
        return out
    monkeypatch.setattr(lowering, "run_passes", recording)
    x = torch.randn(3, 9, 32)
    report = _compare(_layer(32, 2, 4), lambda m: m(x))
    assert report.counts()["slstm"] == 1, str(report)
    assert lowered and not any(torch.ops.aten.stack.default in targets for targets in lowered)


def test_given_state_and_return_last_state_equal_to_eager():
    """An initial state (slstm_state, and the conv state) and return_last_state=True: the output,
    the last sLSTM and conv states, and the gradients of the parameters and of the given state."""
    E, B = 32, 3
    state = _state(B, E).requires_grad_()
    conv_state = torch.randn(B, 4, E, requires_grad=True)
    x = torch.randn(B, 11, E)
    report = _compare(_layer(E, 2, 4), lambda m: m(x, conv_state=conv_state, slstm_state=state,
                                                    return_last_state=True), leaves=(state, conv_state))
    assert report.counts()["slstm"] == 1, str(report)


@pytest.mark.parametrize("n_zero", [slice(None), [1]])
def test_batch_fresh_rule_with_a_given_state_equal_to_eager(n_zero):
    """The package's fresh rule is whole-batch (`if torch.all(n == 0.0)`): a state whose n is zero
    everywhere restarts every row, one whose n is zero in some rows only restarts none."""
    E, B = 32, 3
    state = _state(B, E, n_zero=n_zero).requires_grad_()
    x = torch.randn(B, 5, E)
    layer = _layer(E, 2, 0)
    with collect() as graphs:
        _within_eagers_own_error(layer, lambda m, x, state: m(x, slstm_state=state, return_last_state=True), x, state)
    assert Report(graphs=graphs).counts()["slstm"] == 1, str(Report(graphs=graphs))


def _within_eagers_own_error(model, fn, *inputs):
    """fn(model, *inputs) compiled, its outputs and the gradients of the parameters and inputs
    against float64 eager: each within 1e-5 relative or 3x fp32 eager's own error, whichever is
    larger. For a state whose n is zero in some rows, the state's gradient is ill-conditioned:
    fp32 eager itself is off by up to 4e-5 on about 1% of random inputs."""
    import copy

    def run(m, dtype):
        ins = [t.detach().to(dtype).requires_grad_() for t in inputs]
        outs = _flat(fn(m, *ins))
        gen = torch.Generator().manual_seed(7)
        loss = sum((o * torch.randn(o.shape, generator=gen).to(o.dtype)).sum() for o in outs)
        leaves = [*m.parameters(), *ins]
        return [t.double() for t in [*outs, *torch.autograd.grad(loss, leaves, allow_unused=True)]
                if t is not None]

    want = run(copy.deepcopy(model).double(), torch.float64)
    eager = run(model, torch.float32)
    torch._dynamo.reset()
    got = run(torch.compile(model, backend="xaccel"), torch.float32)
    assert len(got) == len(want) == len(eager)
    for i, (g, e, w) in enumerate(zip(got, eager, want)):
        assert rel_err(g, w) <= max(TOL, 3 * rel_err(e, w)), (i, rel_err(g, w), rel_err(e, w))


def test_decode_steps_are_slstm_step_and_equal_to_eager():
    """sLSTMLayer.step (decoding: the cell's forward on one token, states carried by the caller;
    the conv state is a tuple the step updates in place) traces as xaccel.slstm_step; three steps
    after a prompt's sLSTM state equal eager."""
    E, B = 32, 2
    layer = _layer(E, 2, 4).eval()
    prompt, tokens = torch.randn(B, 6, E), torch.randn(B, 3, E)
    torch._dynamo.reset()
    step = torch.compile(layer.step, backend="xaccel")
    with torch.no_grad(), collect() as graphs:
        slstm_state = layer(prompt, return_last_state=True)[1]["slstm_state"]
        want_state = {"conv_state": (torch.zeros(B, 4, E),), "slstm_state": slstm_state}
        got_state = {"conv_state": (torch.zeros(B, 4, E),), "slstm_state": slstm_state.clone()}
        for t in range(tokens.shape[1]):
            want, want_state = layer.step(tokens[:, t:t + 1], **want_state)
            got, got_state = step(tokens[:, t:t + 1], **got_state)
            assert rel_err(got, want) <= TOL
            for w, g in zip(_flat(want_state), _flat(got_state)):
                assert rel_err(g, w) <= TOL
    report = Report(graphs=graphs)
    assert report.counts()["slstm_step"] >= 1 and report.counts()["slstm"] == 0, str(report)


def test_cell_step_is_slstm_step_and_equal_to_eager():
    """sLSTMCell.step (slstm_forward_step) -> xaccel.slstm_step, forward and gradients."""
    E, B = 32, 3
    cell = _layer(E, 4, 0).slstm_cell
    state = _state(B, E).requires_grad_()
    x = torch.randn(B, 1, 4 * E)
    torch._dynamo.reset()
    want = cell.step(x, state)[0]
    want_grads = torch.autograd.grad(_loss([want]), [*cell.parameters(), state])
    with collect() as graphs:
        got = torch.compile(cell.step, backend="xaccel")(x, state)[0]
    got_grads = torch.autograd.grad(_loss([got]), [*cell.parameters(), state])
    assert rel_err(got, want) <= TOL
    assert all(rel_err(g, w) <= TOL for g, w in zip(got_grads, want_grads))
    assert Report(graphs=graphs).counts()["slstm_step"] == 1


def _block_stack(slstm_at):
    from xlstm import mLSTMBlockConfig, mLSTMLayerConfig, sLSTMBlockConfig, xLSTMBlockStack, xLSTMBlockStackConfig

    cfg = xLSTMBlockStackConfig(
        mlstm_block=mLSTMBlockConfig(mlstm=mLSTMLayerConfig(conv1d_kernel_size=4, qkv_proj_blocksize=4, num_heads=4)),
        slstm_block=sLSTMBlockConfig(slstm=sLSTMLayerConfig(backend="vanilla", num_heads=4, conv1d_kernel_size=4)),
        context_length=32, num_blocks=3, embedding_dim=64, slstm_at=slstm_at)
    torch.manual_seed(0)
    model = xLSTMBlockStack(cfg)
    for i in slstm_at:  # the mLSTM blocks keep the package's init
        _randomize(model, seed=i, prefix=f"blocks.{i}.")
    return model


@pytest.mark.parametrize("S, slstm_at", [(32, [1]), (17, [1]), (17, [0, 2])])
def test_block_stack_with_slstm_and_mlstm_blocks_equal_to_eager(S, slstm_at):
    """mLSTM blocks (parallel_stabilized_simple, the mlstm family's substitution) around sLSTM
    blocks: both families replaced, forward and gradients equal eager; each sLSTM's
    recomputed states dropped."""
    model, x = _block_stack(slstm_at), torch.randn(2, S, 64)
    report = _compare(model, lambda m: m(x))
    counts = report.counts()
    assert counts["slstm"] == len(slstm_at) and counts["mlstm"] == 3 - len(slstm_at), str(report)
    assert not any(r.note for r in report.replacements if r.family == "slstm"), str(report)


def test_block_stack_training_graphs_call_the_ops_past_the_dispatcher(monkeypatch):
    """A compiled train step's forward and backward graphs call every xaccel op's body directly
    (ops.DIRECT_CALLS): through the dispatcher, the mLSTM and sLSTM calls of a training step cost
    more host time than their kernels. The step still equals eager."""
    from torch_xaccel import backend

    lowered = []
    real = backend.eager_calls.rewrite
    monkeypatch.setattr(backend.eager_calls, "rewrite", lambda g: lowered.append(real(g)) or lowered[-1])
    x = torch.randn(2, 17, 64)
    report = _compare(_block_stack([1]), lambda m: m(x))
    assert report.counts()["slstm"] == 1 and report.counts()["mlstm"] == 2, str(report)
    targets = [n.target for g in lowered for n in g.graph.nodes if n.op == "call_function"]
    assert len(lowered) >= 2, "a forward and a backward graph"
    left = {str(t) for t in targets if isinstance(t, torch._ops.OpOverload) and t.namespace == "xaccel"}
    assert not left, left
    from torch_xaccel.ops.mlstm import op as mlstm_op
    from torch_xaccel.ops.slstm import op as slstm_op

    for op in (mlstm_op, slstm_op):  # the forward keeps its states for the backward where kernels run it
        assert op.run in targets or op.run_saving in targets, op.__name__
        assert op.run_backward in targets, op.__name__


def test_block_stack_decode_steps_equal_to_eager():
    """xLSTMBlockStack.step (one token through every block, the state dict carried by the caller):
    the sLSTM block's step traces as xaccel.slstm_step, the mLSTM blocks' as xaccel.mlstm_step;
    four tokens equal eager, output and every state."""
    model = _block_stack([1]).eval()
    tokens = torch.randn(2, 4, 64)
    torch._dynamo.reset()
    step = torch.compile(model.step, backend="xaccel")
    with torch.no_grad(), collect() as graphs:
        want_state, got_state = None, None
        for t in range(tokens.shape[1]):
            want, want_state = model.step(tokens[:, t:t + 1], want_state)
            got, got_state = step(tokens[:, t:t + 1], got_state)
            assert rel_err(got, want) <= TOL
            for w, g in zip(_flat(want_state), _flat(got_state)):
                assert rel_err(g, w) <= TOL
    counts = Report(graphs=graphs).counts()
    assert counts["slstm_step"] >= 1 and counts["mlstm_step"] >= 1, str(Report(graphs=graphs))


@pytest.mark.parametrize("env", [{"XACCEL_DISABLE": "1"}, {"XACCEL_PATTERNS": "gemm_epilogue"}])
def test_switched_off_runs_the_library_code(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    x = torch.randn(2, 7, 32)
    report = _compare(_layer(32, 2, 4), lambda m: m(x))
    assert report.counts()["slstm"] == 0 and report.counts()["slstm_step"] == 0, str(report)


def test_only_the_step_pattern_substitutes_only_steps(monkeypatch):
    """XACCEL_PATTERNS=slstm_step: a sequence traces the library's code, a one-step call the step
    op (seen in Dynamo's graph: the report lists it once the slstm_step pass reports it)."""
    monkeypatch.setenv("XACCEL_PATTERNS", "slstm_step")
    layer, x = _layer(32, 2, 0), torch.randn(2, 7, 32)
    assert _compare(layer, lambda m: m(x)).counts()["slstm"] == 0
    targets = []

    def seeing(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes)
        return xaccel_backend(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        assert rel_err(torch.compile(layer, backend=seeing)(x[:, :1]), layer(x[:, :1])) <= TOL
    assert "xaccel.slstm_step" in targets and "xaccel.slstm" not in targets, targets


def test_bf16_forward_keeps_the_library_dtypes_and_stays_close_to_eager():
    """bf16 at the boundary: output and last state in bf16 as eager's; the op's fp32 state math
    against the package's bf16 math stays within 2e-2 relative (bf16 rounding at every step)."""
    layer = _layer(32, 2, 4).to(torch.bfloat16)
    x = torch.randn(2, 9, 32, dtype=torch.bfloat16)
    state = _state(2, 32).to(torch.bfloat16)
    with torch.no_grad():
        want, want_state = layer(x, slstm_state=state, return_last_state=True)
        torch._dynamo.reset()
        with collect() as graphs:
            got, got_state = torch.compile(layer, backend="xaccel")(x, slstm_state=state, return_last_state=True)
    assert Report(graphs=graphs).counts()["slstm"] == 1
    assert got.dtype == want.dtype == torch.bfloat16
    assert got_state["slstm_state"].dtype == want_state["slstm_state"].dtype == torch.bfloat16
    assert rel_err(got, want) <= 2e-2
    assert rel_err(got_state["slstm_state"], want_state["slstm_state"]) <= 2e-2


def test_trace_holds_one_op_whatever_the_length():
    """Dynamo's graph holds one op (and the recomputation, dropped after lowering: no note)
    instead of a loop: one graph of the same size at T=9 and T=257."""
    sizes = []

    def counting(gm, example_inputs):
        sizes.append(len(gm.graph.nodes))
        return xaccel_backend(gm, example_inputs)

    layer = _layer(32, 2, 4)
    for T in (9, 257):
        torch._dynamo.reset()
        x = torch.randn(2, T, 32)
        with torch.no_grad(), collect() as graphs:
            assert rel_err(torch.compile(layer, backend=counting)(x), layer(x)) <= TOL
        report = Report(graphs=graphs)
        assert report.counts()["slstm"] == 1 and not report.replacements[0].note
    assert len(sizes) == 2 and sizes[0] == sizes[1], sizes


def test_dynamic_sequence_length_substituted_and_equal_to_eager():
    layer = _layer(32, 2, 4)
    torch._dynamo.reset()
    fn = torch.compile(layer, backend="xaccel", dynamic=True)
    with torch.no_grad(), collect() as graphs:
        for T in (5, 12):
            x = torch.randn(2, T, 32)
            assert rel_err(fn(x), layer(x)) <= TOL
    report = Report(graphs=graphs)
    assert report.counts()["slstm"] >= 1, str(report)
    assert not any(r.note for r in report.replacements), "symbolic S: the unread history is dropped too"


def _function_inputs(S, B=3, NH=2, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    H = NH * D
    x = torch.randn(S, B, 4 * H, generator=gen).requires_grad_()
    R = (torch.randn(NH, 4 * D, D, generator=gen) / D ** 0.5).requires_grad_()
    b = torch.randn(4 * H, generator=gen).requires_grad_()
    return x, _state(B, H).requires_grad_(), R, b


@pytest.mark.parametrize("S", [6, 1])
def test_the_library_function_returns_truthful_states_of_every_step_and_gates(S):
    """Called directly, slstm_forward's every result is read: every step's h, c, n, m, the final
    states and the per-step gates equal eager's, and so do the gradients of a loss on all of
    them (the recomputed states are differentiable); the report says they are recomputed."""
    inputs = _function_inputs(S)
    pointwise = slstm_vanilla.slstm_pointwise_function_registry["slstm"]

    def fn(x, state, R, b):
        return slstm_vanilla.slstm_forward(x, state, R, b, pointwise)

    want = fn(*inputs)
    want_grads = torch.autograd.grad(_loss(want), inputs)
    torch._dynamo.reset()
    with collect() as graphs:
        got = torch.compile(fn, backend="xaccel")(*inputs)
    got_grads = torch.autograd.grad(_loss(got), inputs)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and rel_err(g, w) <= TOL
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) <= TOL
    report = Report(graphs=graphs)
    family = "slstm" if S > 1 else "slstm_step"
    assert report.counts()[family] == 1, str(report)
    if S > 1:
        assert "recomputed" in report.replacements[0].note


@pytest.mark.parametrize("case", ["lstm pointwise", "constants"])
def test_other_pointwise_functions_and_constants_trace_the_library_code(case):
    x, state, R, b = (t.detach() for t in _function_inputs(5))
    registry = slstm_vanilla.slstm_pointwise_function_registry
    if case == "lstm pointwise":
        args, kwargs = (x, state[:2], R, b, registry["lstm"]), {}
    else:
        args, kwargs = (x, state, R, b, registry["slstm"]), {"constants": {"unused": 1.0}}

    def fn(*a):
        return slstm_vanilla.slstm_forward(*a, **kwargs)[0]

    want = fn(*args)
    torch._dynamo.reset()
    with collect() as graphs:
        got = torch.compile(fn, backend="xaccel")(*args)
    assert rel_err(got, want) <= 1e-6
    assert Report(graphs=graphs).counts()["slstm"] == 0


def test_report_and_explain_list_the_substitution():
    x = torch.randn(2, 7, 32)
    layer = _layer(32, 2, 4)
    with torch.no_grad():
        report = torch_xaccel.explain(layer, x)
    assert report.counts()["slstm"] == 1, str(report)
    assert PATTERN in str(report)


# what the code after slstm_forward reads of states_all [4, S+1, B, H]: whether that includes
# recomputed states (rows 1-3 of steps 1 .. S-1)
READERS = {
    "h row": (lambda a: a[0], False),
    "last column": (lambda a: a[:, -1], False),
    "first column": (lambda a: a[:, 0], False),
    "h of the steps": (lambda a: a[0][1:], False),
    "the cell's two reads": (lambda a: (a[0][1:], a[:, -1]), False),
    "one batch row's last": (lambda a: a[:, -1, 1], False),
    "n row": (lambda a: a[2], True),
    "a middle step": (lambda a: a[:, -2], True),
    "all but the last step": (lambda a: a[1:, :-1], True),
    "a batch row": (lambda a: a[:, :, 0], True),
    "unbound": (lambda a: a.unbind(0)[3], True),
    "flattened tail": (lambda a: a.flatten()[-70:], True),
    "transposed": (lambda a: a.transpose(0, 1)[1], True),
    "a reduction": (lambda a: a.sum(), True),
    "everything": (lambda a: a, True),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_recomputed_states_dropped_only_where_nothing_reads_them(reader):
    """The recomputation is removed after lowering only where no read can see it: every reader
    equals eager, and the report's note says whether the states were recomputed."""
    read, reads_history = READERS[reader]
    x, state, R, b = (t.detach() for t in _function_inputs(6))
    pointwise = slstm_vanilla.slstm_pointwise_function_registry["slstm"]

    def fn(x, state, R, b):
        return read(slstm_vanilla.slstm_forward(x, state, R, b, pointwise)[0])

    with torch.no_grad():
        want = _flat(fn(x, state, R, b))
        torch._dynamo.reset()
        with collect() as graphs:
            got = _flat(torch.compile(fn, backend="xaccel")(x, state, R, b))
    assert all(rel_err(g, w) <= TOL for g, w in zip(got, want))
    report = Report(graphs=graphs)
    assert report.counts()["slstm"] == 1, str(report)
    assert bool(report.replacements[0].note) == reads_history, str(report)


def test_recomputed_states_kept_where_the_result_is_written_in_place():
    """A write into states_all after the call (here into the h row, through a view) keeps the
    recomputation: the walk does not follow in-place writes."""
    x, state, R, b = (t.detach() for t in _function_inputs(6))
    pointwise = slstm_vanilla.slstm_pointwise_function_registry["slstm"]

    def fn(x, state, R, b):
        states_all = slstm_vanilla.slstm_forward(x, state, R, b, pointwise)[0]
        states_all[0].mul_(2.0)
        return states_all[:, -1], states_all[0]

    with torch.no_grad():
        want = fn(x, state, R, b)
        torch._dynamo.reset()
        with collect() as graphs:
            got = torch.compile(fn, backend="xaccel")(x, state, R, b)
    assert all(rel_err(g, w) <= TOL for g, w in zip(got, want))
    report = Report(graphs=graphs)
    assert report.counts()["slstm"] == 1 and report.replacements[0].note, str(report)


@pytest.mark.gpu
def test_layer_on_gpu_in_bf16_runs_the_kernels_forward_and_backward():
    """The whole path on CUDA: the substitution, the zero state dropped, the training graph's
    saving op, the cluster kernels forward and backward (no fallback event), against the eager
    layer in fp32: outputs within 2e-2, gradients within 5e-2 relative."""
    from torch_xaccel import runtime

    layer32 = _layer(E=768, NH=4, conv=4).cuda()
    layer = _layer(E=768, NH=4, conv=4).cuda().bfloat16()
    x32 = torch.randn(4, 96, 768, device="cuda")
    x = x32.bfloat16().requires_grad_()
    x32.requires_grad_()
    events = len(runtime.EVENTS)
    torch._dynamo.reset()
    with collect() as graphs:
        got = torch.compile(layer, backend="xaccel")(x)
    want = layer32(x32)
    assert rel_err(got, want) < 2e-2
    g = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, [x, *layer.parameters()], g.bfloat16())
    want_grads = torch.autograd.grad(want, [x32, *layer32.parameters()], g)
    for a, w in zip(got_grads, want_grads):
        assert rel_err(a, w) < 5e-2
    assert len(runtime.EVENTS) == events, runtime.EVENTS[-1]
    report = Report(graphs=graphs)
    assert report.counts()["slstm"] == 1, str(report)
    assert any("keeps its per-step states" in r.note for r in report.replacements), str(report)
    assert any(op == "slstm_saving" for op, _, choice in runtime.CHOICES.values() if "cuda" in choice)
