"""Lowering for the sLSTM family.

- substitutions.py: library sLSTM loops Dynamo cannot trace into one graph (the xlstm package's
  vanilla backend breaks the graph at its `if torch.all(n == 0.0)`; FlashRNN's vanilla loops),
  traced as xaccel::slstm / slstm_step (the family's trace hooks)
- cell.py: the step matcher the passes share: the elementwise core found structurally, the
  step's layout measured by running its nodes, the proof against every variant of the op
- loops.py: hand-written loops over time steps that Dynamo unrolled -> one xaccel::slstm
- step.py: a single step (decoding) -> xaccel::slstm_step
- sequence.py: the `slstm` pattern's pass (substituted calls reported, loops collapsed, zero
  initial states dropped: zero_state.py)
- saving.py: training graphs keep what the backward kernel reads (xaccel::slstm_saving)
"""
