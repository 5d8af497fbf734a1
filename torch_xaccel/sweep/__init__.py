"""The performance differential harness: `python -m torch_xaccel.bench sweep`.

Model forms (forms.py) x sizes x dtypes x modes, each row in its own process (run.py), timing
eager, Inductor default and xaccel default in interleaved rounds, with the xaccel output checked
against eager and an fp32/fp64 reference.
"""
