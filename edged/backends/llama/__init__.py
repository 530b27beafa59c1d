"""Language models through llama.cpp: the backend, its batched context and its kept prefixes.

``LlamaBackend`` is imported on first use, so that the pure parts (``prefixes``, ``statefile``)
load without llama-cpp-python installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edged.backends.llama.backend import LlamaBackend

__all__ = ["LlamaBackend"]


def __getattr__(name: str) -> Any:
    if name == "LlamaBackend":
        from edged.backends.llama.backend import LlamaBackend

        return LlamaBackend
    raise AttributeError(name)
