"""Lowering for the sLSTM family.

Users write the step in many layouts: states [B, NH, D] or [B, NH*D]; the recurrence as an einsum,
per-head matmuls, a bmm or one batched matmul; the gates split by chunk, unbind or indexing, along
any dim. Rather than one pattern per layout, a step is found by its elementwise core, its layouts
are then measured and what it computes proven:

- nodes.py: the ATen vocabulary the matchers read (views, linear ops, factories) and node facts
- prepare.py: the cheap filter, and rewrites that keep every value (same-dtype casts, repeated
  elementwise expressions folded) so that one walk sees every spelling
- core.py: the elementwise core around each stabilizer's max, found structurally
- cell.py: the step as a whole (pre-activation, roots, region), and its nodes as a function
- plans.py: views from the roots to the op's Wx, R, b; the state layout (StateMap)
- measure.py: the layouts, measured by running the pre-activation on structured inputs
- variants.py: the proof: which variant of the op (or which construct it cannot express) a step
  computes
- batch.py: a symbolic batch size
- emit.py: writing the op into the graph; marking a refused region as reported
- prologue.py: a loop's first step written apart (`if t == 0:`)
- substitutions.py: library sLSTM loops Dynamo cannot trace into one graph (the xlstm package's
  vanilla backend breaks the graph at its `if torch.all(n == 0.0)`; FlashRNN's vanilla loops),
  traced as xaccel::slstm / slstm_step (the family's trace hooks)
- loops.py: hand-written loops over time steps that Dynamo unrolled -> one xaccel::slstm
- step.py: a single step (decoding) -> xaccel::slstm_step
- sequence.py: the `slstm` pattern's pass (substituted calls reported, loops collapsed, zero
  initial states dropped: zero_state.py)
- saving.py: training graphs keep what the backward kernel reads (xaccel::slstm_saving)
"""
