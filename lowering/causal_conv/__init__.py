"""The causal_conv pass (families.py lists it):

- conv1d.py (pattern "causal_conv"): a depthwise conv1d made causal (padded by K - 1 on both
  sides and cut to the first S outputs, or fed an input left-padded by K - 1 zeros)
  -> xaccel.causal_conv1d
"""
