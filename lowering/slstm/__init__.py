"""Lowering for the sLSTM family.

- substitutions.py: library sLSTM loops Dynamo cannot trace into one graph (the xlstm package's
  vanilla backend breaks the graph at its `if torch.all(n == 0.0)`), traced as xaccel::slstm
"""
