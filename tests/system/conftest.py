"""Fixtures of the system tests: each test boots its own systemd in private namespaces.

See systemd_ns.py for how, and docs/systemd.md ("System tests") for why each step is there.
The tests skip, with the reason, when not root or when this machine cannot boot systemd; under
CI (where .ci/run is root on a machine that boots it) either is a failure instead
(tests.helpers.unavailable), so a broken namespace set-up cannot pass green as a row of skips.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
from ns_host import BootError, missing_prerequisite
from systemd_ns import Boot, BootOptions, SystemdNamespace

from tests.helpers import unavailable


@pytest.fixture(scope="session")
def systemd_prerequisite() -> str | None:
    return missing_prerequisite()


@pytest.fixture
def boot_systemd(systemd_prerequisite: str | None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Boot]:
    """``boot_systemd({"x.service": text, "x.service.d/y.conf": text}, BootOptions(...))`` boots
    a systemd whose edged-test.target wants those units; every namespace is torn down after the
    test (units stopped, then its init killed by PID, then its cgroup removed)."""
    if systemd_prerequisite is not None:
        unavailable(systemd_prerequisite)
    booted: list[SystemdNamespace] = []

    def boot(units: Mapping[str, str], options: BootOptions | None = None) -> SystemdNamespace:
        work = tmp_path_factory.mktemp("systemd-ns")
        keep = tmp_path_factory.getbasetemp()
        ns = SystemdNamespace(work, dict(units), keep, options or BootOptions())
        booted.append(ns)
        try:
            ns.boot()
        except (BootError, TimeoutError) as e:
            unavailable(f"systemd cannot boot in a namespace here: {e}")
        return ns

    yield boot
    for ns in booted:
        ns.shutdown()
