"""The mlstm passes (families.py lists them):

- step.py (pattern "mlstm_step", first): the xlstm package's native recurrent step, and loops of
  such steps over a sequence fused into one xaccel.mlstm
- parallel.py (pattern "mlstm"): the stabilized parallel form, walked structurally; the library
  calls substituted while Dynamo traced (substitutions.py) reported; what the walk left over:
  mLSTM-shaped regions found by data flow (regions.py), proven by running them and replaced by
  xaccel.mlstm (with start and final states) or xaccel.mlstm_step (provenance.py)
- saving.py (after the passes, training graphs): mLSTMs keep their chunk states for the backward
  (xaccel::mlstm_saving)
"""
