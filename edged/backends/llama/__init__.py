"""Language models through llama.cpp: the backend, its batched context and its kept prefixes."""

from edged.backends.llama.backend import LlamaBackend

__all__ = ["LlamaBackend"]
