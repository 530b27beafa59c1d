"""The console of a booted systemd: a pseudo-terminal that stands in for the namespace's
/dev/console, with what PID 1 writes there copied to a file on the host.
"""

from __future__ import annotations

import os
import threading
import tty
from pathlib import Path


class ConsoleCapture:
    """A pseudo-terminal bind-mounted over the namespace's /dev/console, copied to a file.

    PID 1 runs with --log-target=console so its messages do not depend on journald, and systemd
    writes only to a terminal there (it checks isatty), so a plain file cannot stand in.
    """

    def __init__(self, path: Path) -> None:
        self.master, self._slave = os.openpty()
        tty.setraw(self._slave)
        self.tty = os.ttyname(self._slave)
        self._out = path.open("wb", buffering=0)
        self._thread = threading.Thread(target=self._copy, name="console", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every slave end is closed
                return
            if not data:
                return
            self._out.write(data)

    def close(self) -> None:
        os.close(self._slave)
        self._thread.join(timeout=10)
        os.close(self.master)
        self._out.close()
