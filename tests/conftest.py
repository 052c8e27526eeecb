"""Shared pytest setup: CPU-only by default; torch (a test dependency) kept to two threads."""

try:
    import torch
except ImportError:  # torch is only needed by the HF-reference tests
    torch = None

if torch is not None:
    torch.set_num_threads(2)
