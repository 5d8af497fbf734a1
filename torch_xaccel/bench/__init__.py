"""Side-by-side timings on the GPU, every path measured in one run:

    python -m torch_xaccel.bench causal_conv|gemm_epilogue|group_norm|headwise|mlstm|model|skinny_linear|slstm
        [--out DIR] [--quick] [--no-max-autotune] [--only TEXT] [--paths REGEX]

Prints one table (xaccel, eager, Inductor default, Inductor max-autotune, the cuBLAS matmuls
alone) with times, TFLOP/s and ratios, checks xaccel against an fp32 reference, and writes
DIR/bench_<suite>.md and DIR/bench_<suite>.png.

    python -m torch_xaccel.bench sweep [--quick] [--only TEXT] [--list] [--cpu] [--out DIR] ...

runs the performance differential harness instead (torch_xaccel/sweep: model forms x sizes x
dtypes x modes, eager vs Inductor vs xaccel, each row in its own process; `sweep --help`).

cli.py is the command line, common.py what every suite shares (Case, the timing, run_case, the
table); a family's suite is the module of the family's name (families.py's `bench` names its
cases), model.py the whole-model suite. Nothing is imported here, so that one suite's module
loads without the others.
"""
