"""The group_norm pass (families.py lists it):

- rows.py (pattern "group_norm"): a group norm of rows [N, C] (the xlstm package's per-head layer
  norm) -> xaccel.group_norm
"""
