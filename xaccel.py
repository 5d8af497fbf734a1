"""Lets TORCH_LOGS="xaccel" pass torch's check at `import torch`, before torch_xaccel registers the
name (torch_xaccel/logs.py): torch accepts a log name that is an importable module. Nothing here runs."""
