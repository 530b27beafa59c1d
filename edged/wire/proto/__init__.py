"""Triton's protocol buffers and the Python modules generated from them (README.md here)."""
