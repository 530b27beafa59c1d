"""edged's memory probe against jetson-stats' real jtop service, off-Jetson.

The service runs as PID 1 of private PID and mount namespaces (see jtop_ns.py for what it needs
and where it writes); edged's probe and ``edged plan`` run in the same namespaces, so they find
/run/jtop.sock as on a Jetson, while the machine's /run, /etc, /sys and /dev/shm never see it.
What this proves: the keys and units edged reads from ``jetson.memory["RAM"]`` are the ones a real
service sends, ``probe("auto")`` picks jtop when its socket exists, and the plan reports it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from jtop_ns import FAKE_DMI, JTOP_SOCKET, JtopNamespace, SetupError, jtop_config_dir, missing_prerequisite

from tests.helpers import unavailable

PROBE = "from edged.host.memory import probe; i = probe('auto'); print(i.source, i.total, i.available)"
RAM = (
    "import json; from jtop import jtop\n"
    "with jtop() as j:\n"
    "    print(json.dumps({'ram': j.memory['RAM'], 'hardware': j.board['hardware']}))"
)


def mem_total_kib(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1])
    raise AssertionError(f"no MemTotal in {meminfo}")


def host_state() -> dict[str, object]:
    """What the test must leave as it found it on the machine."""
    config_dir = jtop_config_dir()
    dmi = Path("/sys/devices/virtual/dmi/id")
    return {
        "/run/jtop.sock": Path(JTOP_SOCKET).exists(),
        "/etc/group": Path("/etc/group").read_bytes(),
        "/etc/gshadow": Path("/etc/gshadow").read_bytes() if Path("/etc/gshadow").exists() else None,
        "jtop config dir": config_dir.exists(),
        "dmi": sorted(p.name for p in dmi.iterdir()) if dmi.is_dir() else None,
        "jtop.service": [
            p for p in ("/etc/systemd/system/jtop.service", "/lib/systemd/system/jtop.service") if Path(p).exists()
        ],
    }


def edged_command() -> list[str]:
    script = Path(sys.executable).parent / "edged"
    return [str(script)] if script.exists() else [sys.executable, "-m", "edged"]


@pytest.mark.system
def test_memory_probe_reads_the_real_jtop_service(tmp_path: Path) -> None:
    reason = missing_prerequisite()
    if reason is not None:
        unavailable(reason)  # under CI (root, jetson-stats from scripts/test.sh): a failure
    config = tmp_path / "edged.toml"
    config.write_text(
        '[server]\nsocket = "run/edged.sock"\n\n[cache]\ndir = "cache"\n\n'
        '[memory]\nbudget = "50%"\nreserve = "64MiB"\nprobe = "auto"\n'
    )
    before = host_state()
    work = tmp_path / "ns"
    work.mkdir()
    ns = JtopNamespace(work)
    try:
        try:
            ns.start()
        except SetupError as e:
            unavailable(f"cannot build the jtop namespace here: {e}")
        # What jtop itself saw: the namespace's /proc (same kernel, so the machine's figure).
        total_kib = mem_total_kib(ns.root_path("/proc/meminfo"))

        # The service's RAM dict, as edged's probe_jtop reads it: tot/used/shared, in KiB.
        out = ns.run(sys.executable, "-c", RAM)
        assert out.returncode == 0, f"jtop client failed:\n{out.stdout}\n{out.stderr}\n{ns.log()}"
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        ram = seen["ram"]
        assert {"tot", "used", "shared"} <= ram.keys(), ram
        assert ram["tot"] == total_kib, (ram, total_kib)
        assert 0 < ram["used"] < ram["tot"], ram
        # The service read the fake DMI (so it is the namespace's service, set up as intended).
        assert seen["hardware"].get("Product name") == FAKE_DMI["product_name"], seen["hardware"]

        # edged's probe, auto: the socket exists in here, so jtop comes first.
        out = ns.run(sys.executable, "-c", PROBE)
        assert out.returncode == 0, f"probe failed:\n{out.stdout}\n{out.stderr}\n{ns.log()}"
        source, total, available = out.stdout.split()
        assert source == "jtop", out.stdout
        expected = total_kib * 1024
        assert abs(int(total) - expected) <= expected * 0.02, (total, expected)
        assert 0 < int(available) <= int(total), out.stdout

        # edged plan, as an operator would run it on the device.
        out = ns.run(*edged_command(), "plan", "--config", str(config), "--json")
        assert out.returncode == 0, f"edged plan failed:\n{out.stdout}\n{out.stderr}\n{ns.log()}"
        memory = json.loads(out.stdout)["memory"]
        assert memory["source"] == "jtop", memory
        assert abs(memory["total_bytes"] - expected) <= expected * 0.02, memory
        assert 0 < memory["available_bytes"] <= memory["total_bytes"], memory
    finally:
        ns.stop()
    assert "Service closed" in ns.log(), f"jtop's service did not close cleanly:\n{ns.log()[-3000:]}"
    assert host_state() == before, "the test changed the machine"
