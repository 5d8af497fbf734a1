"""The pointwise family's pass (`groups.py`): groups of elementwise ops in the graphs the rest of a
compile runs eagerly, fused into xaccel.pointwise calls."""
