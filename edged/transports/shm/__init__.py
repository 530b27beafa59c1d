"""Shared memory: registered regions tied to their peer, the sealed-memfd descriptor socket,
bounded copies in and out, outputs written by the model's worker."""
