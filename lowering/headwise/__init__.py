"""The headwise pass (families.py lists it):

- einsum.py (pattern "headwise"): an einsum that applies one small linear map per head
  (x [..., H, D] with w [H, O, D] in any label order) -> xaccel.headwise
"""
