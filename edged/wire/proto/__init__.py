"""Triton's model configuration message and the Python modules generated from it (README.md here)."""
