"""The interpreter and PYTHONPATH with which a hardened unit in the namespace runs edged from
this checkout.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ns_host import REPO

SYSTEM_PYTHON = Path("/usr/bin/python3")


def python_for_units() -> tuple[str, str]:
    """An interpreter that a hardened unit can run (ProtectHome= hides a venv whose python lives
    under /root) and a PYTHONPATH that lets it import edged, plus this venv's site-packages when
    the versions match (C extensions such as systemd-python are built for one ABI)."""
    if not SYSTEM_PYTHON.exists():
        return sys.executable, str(REPO)
    probe = [str(SYSTEM_PYTHON), "-c", "import sys; print(sys.version_info[:2])"]
    version = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
    paths = [str(REPO)]
    if version == str(sys.version_info[:2]):
        paths.extend(p for p in sys.path if p.endswith("site-packages"))
    return str(SYSTEM_PYTHON), ":".join(paths)
