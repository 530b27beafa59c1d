"""edged: an on-device inference daemon for NVIDIA Jetson (and any Linux machine on the CPU)."""

__version__ = "0.1.0"
