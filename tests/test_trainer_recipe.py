"""docs/recipes.md's transformers `Trainer` recipe: `model.compile(backend="xaccel")` before the
model goes to `Trainer` (small xLSTMForCausalLM, random weights, no download, CPU).

The compiled run trains on the replacements (one graph for every step, each mLSTM replaced), its
losses, first-step gradients and trained weights equal the uncompiled Trainer's from the same seed
within the mLSTM tests' fp32 tolerance, and its checkpoints hold plain keys: `from_pretrained`
loads them into an uncompiled model and `resume_from_checkpoint` continues the same run.
`TrainingArguments(torch_compile_backend="xaccel")` is refused by accelerate (the last test says
how, so it fails when that changes and the recipe can name the argument instead)."""
import pytest
import torch

from tests.helpers import rel_err
from tests.mlstm.test_transformers import TOL, _model  # the suite's small xLSTMForCausalLM config
from torch_xaccel.report import Report, collect

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

STEPS = 3


def _dataset():
    """One batch of two sequences, seen at every step: the loss of plain gradient descent on a fixed
    batch falls at a small enough learning rate, so a rising loss means wrong gradients."""
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": t, "labels": t} for t in tokens]


def _args(output_dir, **extra):
    # SGD at a constant rate: the update is linear in the gradient, so the weights after the steps
    # carry the gradients' fp32 error rather than Adam's sign-like first step amplifying it
    return TrainingArguments(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=2,
                             optim="sgd", learning_rate=0.1, lr_scheduler_type="constant", logging_steps=1,
                             save_steps=1, seed=0, report_to="none", use_cpu=True, disable_tqdm=True, **extra)


class _FirstStepGradients(TrainerCallback):
    """The parameters' gradients of the first step, as the optimizer gets them."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _train(output_dir, compiled: bool):
    """The recipe (compiled) or the same run uncompiled: the trained model, the per-step losses,
    the first step's gradients and the backend's graphs."""
    model = _model(transformers, mode="train")
    if compiled:
        model.compile(backend="xaccel")
    grads = _FirstStepGradients()
    trainer = Trainer(model=model, args=_args(output_dir), train_dataset=_dataset(), callbacks=[grads])
    with collect() as graphs:
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, losses, grads.grads, graphs, output_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch._dynamo.reset()
    compiled = _train(tmp_path_factory.mktemp("compiled"), compiled=True)
    torch._dynamo.reset()
    plain = _train(tmp_path_factory.mktemp("plain"), compiled=False)
    torch._dynamo.reset()
    return {"compiled": compiled, "plain": plain}


def test_trainer_trains_on_the_replacements_and_matches_the_uncompiled_run(runs):
    model, losses, grads, graphs, _ = runs["compiled"]
    want_model, want_losses, want_grads, plain_graphs, _ = runs["plain"]
    report = Report(graphs)
    # one graph for the whole run: compiled at the first step, no break, no recompile after it
    assert len(graphs) == 1 and not plain_graphs, str(report)
    counts = report.counts()
    assert counts["mlstm"] == 2 and counts["gemm_epilogue"] > 0, str(report)
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses, strict=True)) <= TOL, (losses, want_losses)
    assert grads.keys() == want_grads.keys() and len(grads) == len(list(model.parameters()))
    assert max(rel_err(grads[n], want_grads[n]) for n in grads) <= TOL
    got, want = dict(model.named_parameters()), dict(want_model.named_parameters())
    assert max(rel_err(got[n], want[n]) for n in got) <= TOL


def test_checkpoints_hold_plain_keys_and_load_uncompiled_or_resume_compiled(runs, tmp_path):
    """model.compile keeps the model itself in the Trainer (not a torch.compile wrapper whose keys
    start with `_orig_mod.`): the checkpoint loads into a fresh, uncompiled model with every key
    and equal weights, and resuming at step 2 with a freshly compiled model ends on the same
    weights as the uninterrupted run."""
    model, *_, root = runs["compiled"]
    fresh, info = transformers.xLSTMForCausalLM.from_pretrained(root / f"checkpoint-{STEPS}", output_loading_info=True)
    assert not any(info.values()), info
    trained, loaded = model.state_dict(), fresh.state_dict()
    assert trained.keys() == loaded.keys()
    assert all(torch.equal(trained[k], loaded[k]) for k in trained)

    torch.manual_seed(1)
    resumed = transformers.xLSTMForCausalLM(model.config)  # other weights, replaced by the checkpoint's
    resumed.compile(backend="xaccel")
    with collect() as graphs:
        Trainer(model=resumed, args=_args(tmp_path), train_dataset=_dataset()).train(
            resume_from_checkpoint=str(root / "checkpoint-2"))
    assert len(graphs) == 1 and Report(graphs).counts()["mlstm"] == 2, str(Report(graphs))
    got, want = dict(resumed.named_parameters()), dict(model.named_parameters())
    assert max(rel_err(got[n], want[n]) for n in want) <= 1e-6


def test_trainings_compile_argument_does_not_take_the_backend(tmp_path):
    """transformers takes the name (TrainingArguments turns torch_compile on) and hands it to
    accelerate's TorchDynamoPlugin, which accepts only the members of its DynamoBackend enum: the
    Trainer cannot be built. When this fails, accelerate takes registered backends: test that
    route and name it in docs/recipes.md."""
    args = _args(tmp_path, torch_compile_backend="xaccel")
    assert args.torch_compile and args.torch_compile_backend == "xaccel"
    with pytest.raises(ValueError, match=r"^'XACCEL' is not a valid DynamoBackend$"):
        Trainer(model=_model(transformers, mode="train"), args=args, train_dataset=_dataset())
