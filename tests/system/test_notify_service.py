"""The harness's first proof: a trivial Type=notify service under a real systemd 252.

The service is a Python one-liner that sends STATUS=, then blocks on a FIFO until the test lets
it go, then sends READY=1 through edged.host.systemd.notify. So the test knows READY=1 has not been
sent while it looks at the "activating" state, without timing anything.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from ns_host import REPO
from ns_waits import open_fifo_writer
from systemd_ns import Boot, SystemdNamespace

ONE_LINER = (
    "import edged.host.systemd as s, signal; "
    "s.status('waiting for go'); "
    "open('{fifo}').read(); "
    "s.notify('READY=1', 'STATUS=warm'); "
    "signal.pause()"
)


def notify_unit(fifo: Path) -> str:
    one_liner = ONE_LINER.format(fifo=fifo)
    return f"""[Unit]
Description=edged notify probe

[Service]
Type=notify
Environment=PYTHONPATH={REPO}
ExecStart={sys.executable} -c "{one_liner}"
"""


@pytest.mark.system
def test_active_only_after_ready(boot_systemd: Boot, tmp_path: Path) -> None:
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    unit = notify_unit(fifo)
    ns: SystemdNamespace = boot_systemd({"probe.service": unit})

    # STATUS= arrived (the service ran its first line) and systemd still waits for READY=1.
    ns.wait_state("probe.service", "activating")
    ns.wait_property("probe.service", "StatusText", "waiting for go")
    assert ns.state("probe.service") == "activating"
    assert ns.show("probe.service", "SubState")["SubState"] == "start"

    go = open_fifo_writer(fifo)  # the service has opened its end: READY=1 is its next line
    os.write(go, b"go")
    os.close(go)
    ns.wait_state("probe.service", "active")
    shown = ns.show("probe.service", "StatusText", "SubState", "MainPID", "Type")
    assert shown["StatusText"] == "warm"
    assert shown["SubState"] == "running"
    assert shown["Type"] == "notify"
    assert int(shown["MainPID"]) > 0
