"""The skinny_linear pass (families.py lists it):

- shared_input.py (pattern "skinny_linear"): the linears with few outputs of one input, such as
  the xlstm package's mLSTM gate projections `igate(cat(q, k, v))`, `fgate(...)` -> one
  xaccel.skinny_linear reading the concatenation's parts in place
"""
