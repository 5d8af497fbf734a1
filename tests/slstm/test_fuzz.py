"""Differential fuzzing of hand-written sLSTM code (tests/slstm/fuzz.py): random styles of the loop
and the step, compiled with the xaccel backend, must equal eager in forward and every input's
gradient (fp32, 1e-5 relative); a true sLSTM must become xaccel.slstm (xaccel.slstm_step for one
step) unless the lowering refuses it by a reason the generator predicts, a look-alike (another
function) must never be replaced, and an exponential forget gate is refused in one report line
that names it.

CI runs a fixed budget of seeds; XACCEL_FUZZ_CASES=N runs N (XACCEL_FUZZ_START the first seed).
A failing case prints its program and how to rerun it alone."""
import pytest

from tests.helpers import fuzz_batch, fuzz_budget
from tests.slstm.fuzz import EXP_FORGET, LOOK_ALIKES, NO_RULE_CLAMP, NO_RULE_READ, NOT_A_VIEW, TIE, check, generate

DEFAULT = 20
START, CASES = fuzz_budget(DEFAULT)
BATCH = 10


@pytest.mark.parametrize("first", range(START, START + CASES, BATCH))
def test_random_slstm_programs_match_eager(first):
    fuzz_batch(range(first, min(first + BATCH, START + CASES)), generate, check, lambda c: c.reproducer())


def test_the_generator_covers_what_it_promises():
    """The generator still writes each style it is for (a generator that silently stopped writing
    time-major inputs or the batch rule would prove nothing), and CI's seeds hold true forms, a
    predicted refusal, look-alikes and one step."""
    cases = [generate(seed) for seed in range(300)]
    sources = "\n".join(c.source for c in cases)
    for needle in ("torch.einsum('bhk,hgjk->bghj'", "torch.einsum('bhk,hkgj->bghj'", "hh[:, k] @ R[k]",
                   "torch.matmul(hh.unsqueeze(2), R)", "torch.bmm(", "torch.block_diag(", ".chunk(4, -1)",
                   "torch.split(raw, H", ".unbind(1)", "[raw[:, k] for k in range(4)]", "Wx[t]", "Wx[:, t]",
                   "Wx.select(", "xs = Wx.unbind(", "@ W)", "Wx = Wx + b", "torch.where(n == 0, g_i, mn)",
                   "torch.all(n == 0)", "torch.minimum(ig, torch.ones_like(ig))", "ig.clamp(max=1.0)",
                   "torch.maximum(n, torch.ones_like(n))", "torch.clamp(n, min=1.0)", "torch.stack(hs, 1)",
                   "torch.cat(", "out[:, t] = h", "hs[-1]", "return torch.stack(hs, 0), c, n, m",
                   "h, c, n, m = h0, c0, n0, m0", "h = c = n = m = torch.zeros", ".new_zeros(B, NH, D)",
                   "h.view(B, D, NH).transpose(1, 2)", "c.to(x_t.dtype)",
                   # the spellings of issue 56: the textbook stabilizer, R [4, NH, D, D] through bmm, a first
                   # step written apart, an exponential forget gate
                   "torch.exp(F.logsigmoid(g_f) + m - mn)", "torch.max(g_i, F.logsigmoid(g_f) + m)",
                   ".repeat(4, 1, 1), R.view(4 * NH, D, D))", ".expand(4, NH, B, D).reshape(4 * NH, B, D)",
                   "if t == 0:\n            raw = ", "if t == 0:\n            mn = g_i",
                   "c, n, m = torch.tanh(g_z), torch.ones_like(g_i), g_i", "logfm = g_f + m"):
        assert needle in sources, needle
    assert {c.T for c in cases} >= {1, 2, 3, 5, 7}
    assert {c.mode for c in cases} == {"grad", "no_grad"} and {c.dynamic for c in cases} == {None, False, True, "batch"}
    assert {c.style["slip"] for c in cases if c.kind == "look-alike"} == set(LOOK_ALIKES)
    assert {r for c in cases for r in c.refusal} == {TIE, NO_RULE_CLAMP, NO_RULE_READ, NOT_A_VIEW, EXP_FORGET}
    ci = [generate(seed) for seed in range(DEFAULT)]
    assert {c.kind for c in ci} >= {"slstm", "look-alike", "exp-forget"} and any(c.refusal for c in ci)
    assert any(c.style["first"] and c.kind == "slstm" and not c.refusal for c in ci)
    assert any(c.T == 1 and c.kind == "slstm" and not c.refusal for c in ci)
    assert any(c.T > 1 and c.kind == "slstm" and not c.refusal for c in ci)
    assert any(c.dynamic == "batch" and c.kind == "slstm" for c in ci)  # run at two batch sizes
