"""The gemm_epilogue passes: GEMM + elementwise chains in forward graphs (chains.py) and in
aot_autograd's backward graphs (backward.py, folding what the backward trace leaves first)."""
