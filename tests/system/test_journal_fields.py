"""edged.host.systemd.setup_logging under a real systemd and journald: the fields arrive.

With systemd-python, LogRecord extras become the journal fields MODEL=, REQUEST_ID=, PHASE=;
without it, stderr lines carry a ``<N>`` priority prefix that journald turns into PRIORITY=.
"""

from __future__ import annotations

import sys

import pytest
from ns_host import REPO
from ns_waits import wait_until
from systemd_ns import Boot

from edged.host import systemd as sd
from tests.helpers import unavailable

ONE_LINER = (
    "import logging, signal, edged.host.systemd as s; "
    "s._sd_journal = None if {fallback} else s._sd_journal; "
    "s.setup_logging('info'); "
    "logging.getLogger('edged.probe').warning('slow inference', "
    "extra=dict(model='detector', request_id='r-42', phase='infer')); "
    "s.ready(); signal.pause()"
)


def logging_unit(fallback: bool) -> str:
    return f"""[Service]
Type=notify
Environment=PYTHONPATH={REPO}
ExecStart={sys.executable} -c "{ONE_LINER.format(fallback=fallback)}"
"""


@pytest.mark.system
def test_extras_become_journal_fields(boot_systemd: Boot) -> None:
    if sd._sd_journal is None:
        unavailable("systemd-python is not installed (pip install 'edged[systemd]')")
    ns = boot_systemd({"probe.service": logging_unit(fallback=False)})
    ns.wait_state("probe.service", "active")

    def entry() -> dict[str, str] | None:
        found = ns.journal("SYSLOG_IDENTIFIER=edged", "MESSAGE=slow inference")
        return found[0] if found else None

    got = wait_until(entry, 20, "the log entry in the journal")
    assert got["MODEL"] == "detector"
    assert got["REQUEST_ID"] == "r-42"
    assert got["PHASE"] == "infer"
    assert got["PRIORITY"] == "4"
    assert got["LOGGER"] == "edged.probe"
    assert got["_TRANSPORT"] == "journal"
    assert got["_SYSTEMD_UNIT"] == "probe.service"


@pytest.mark.system
def test_stderr_fallback_keeps_priority_and_fields(boot_systemd: Boot) -> None:
    ns = boot_systemd({"probe.service": logging_unit(fallback=True)})
    ns.wait_state("probe.service", "active")

    def entry() -> dict[str, str] | None:
        found = [
            e
            for e in ns.journal("_SYSTEMD_UNIT=probe.service", "_TRANSPORT=stdout")
            if "slow inference" in e.get("MESSAGE", "")
        ]
        return found[0] if found else None

    got = wait_until(entry, 20, "the stderr line in the journal")
    # The "<4>" prefix was parsed into PRIORITY= and removed; the time is journald's own.
    assert got["PRIORITY"] == "4"
    assert got["MESSAGE"] == ("WARNING edged.probe: slow inference model=detector request_id=r-42 phase=infer")
