"""The mlstm passes (families.py lists them):

- step.py (pattern "mlstm_step", first): the xlstm package's native recurrent step, and loops of
  such steps over a sequence fused into one xaccel.mlstm
- parallel.py (pattern "mlstm"): the stabilized parallel form, walked structurally; the library
  calls substituted while Dynamo traced (substitutions.py) reported; provenance.py's numeric
  proof for known library kernels and for what the walk left over
- chunk_states.py (after the passes, training graphs): mLSTMs keep their chunk states for the backward
"""
