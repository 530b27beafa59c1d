"""A fleet on one machine for the tests and the benchmark: two real mosquitto brokers bridged
(a device-side one the daemons connect to, a central one the controller talks to, as a
building's broker bridges to a cloud cluster), signed bundle archives of the tiny MLP, and the
config of a daemon that follows its group's desired state."""

from __future__ import annotations

import hashlib
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt

from edged.fleet import desired
from edged.fleet.bundle import make_bundle
from edged.fleet.signing import sign_bundle
from edged.tools.demo import make_tiny_mlp
from tests.helpers import DaemonProcess, write_config
from tests.integration.mosquitto import Broker, Peer

GROUP = "line-1"
PREFIX = "edged"


def bridge(edge: Broker, central: Broker) -> None:
    """The edge broker forwards everything under the prefix both ways, keeping its session (and
    what it queued) across a restart of either side."""
    with open(edge.conf, "a") as f:
        f.write(
            "\n".join(
                [
                    "connection central",
                    f"address 127.0.0.1:{central.port}",
                    f"topic {PREFIX}/# both 1",
                    "try_private true",
                    "cleansession false",
                    "restart_timeout 1 2",
                    "keepalive_interval 5",
                    "",
                ]
            )
        )


@dataclass(frozen=True)
class Release:
    archive: Path
    version: str
    sha256: str
    size: int

    def target(self, url: str = "") -> desired.Target:
        return desired.Target(url or str(self.archive), self.sha256, self.version, self.size)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def release(
    folder: Path,
    version: str,
    key: Path | None,
    *,
    hidden: int = 32,
    in_dim: int = 16,
    model: dict[str, Any] | None = None,
    pad: int = 0,
    tamper: bool = False,
    name: str = "m",
) -> Release:
    """A bundle of a tiny MLP (``hidden`` units: each width answers differently; ``in_dim``
    inputs: another number breaks every client of the model), signed with
    ``key`` and archived. ``pad``: bytes of filler (a download that takes a while); ``tamper``:
    one byte of the model changed after signing."""
    src = folder / f"src-{name}-{version}-{hidden}"
    (src / "calibration").mkdir(parents=True)
    make_tiny_mlp(src / "model.onnx", in_dim=in_dim, hidden=hidden)
    rng = np.random.default_rng(3)
    for i in range(6):
        np.save(src / "calibration" / f"{i}.npy", rng.standard_normal((1, 16)).astype(np.float32))
    files = {"model.onnx": src / "model.onnx", "calibration": src / "calibration"}
    if pad:
        (src / "filler.bin").write_bytes(rng.integers(0, 256, pad, dtype=np.uint8).tobytes())
        files["filler.bin"] = src / "filler.bin"
    table = model or {"path": "model.onnx", "backend": "onnxruntime"}
    root = make_bundle(
        folder / f"{name}-{version}-{hidden}{'-t' if tamper else ''}",
        name=name,
        version=version,
        model=table,
        files=files,
    )
    if key is not None:
        sign_bundle(root, key)
    if tamper:
        data = bytearray((root / "model.onnx").read_bytes())
        data[-1] ^= 0x01
        (root / "model.onnx").write_bytes(bytes(data))
    archive = root.with_suffix(".tar")
    with tarfile.open(archive, "w") as tar:
        tar.add(root, arcname=root.name)
    return Release(archive, version, digest(archive), archive.stat().st_size)


# Calibration that cannot meet this gate: INT8 is never within 1e-9 of FP32, and the search for
# float nodes is off, so the build serves fp32 and reports the failed gate.
MISSED_GATE = {
    "path": "model.onnx",
    "backend": "onnxruntime",
    "precision": "int8",
    "calibration": {"data": "calibration"},
    "gate": {"metric": "rel_l2", "max_rel_l2": 1e-9, "search": "off"},
}


def device(
    folder: Path, name: str, port: int, trust: Path, model: Path, fleet: dict[str, Any] | None = None
) -> DaemonProcess:
    """A daemon serving ``m`` from the config file and following the group's desired state."""
    folder.mkdir(parents=True, exist_ok=True)
    tables: dict[str, dict[str, Any]] = {
        "server": {"socket": str(folder / "edged.sock")},
        "cache": {"dir": str(folder / "cache")},
        "build": {"block_ready": True},
        "lifecycle": {"watch_files": False},
        "mqtt": {"enabled": False, "host": "127.0.0.1", "port": port, "device_id": name, "reconnect_max_s": 1.0},
        "fleet": {
            "follow": True,
            "group": GROUP,
            "trust": [str(trust)],
            "require_signed": True,
            "watch_s": 0,
            "retry_s": 0.5,
            "heartbeat_interval_s": 1.0,
            **(fleet or {}),
        },
        "models.m": {"path": str(model), "backend": "onnxruntime"},
    }
    cfg = write_config(folder / "edged.toml", tables)
    return DaemonProcess(cfg, folder / "edged.sock", folder / "edged.log")


def state_of(received: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(received.payload)
    return doc


class Observer(Peer):
    """A Peer that subscribes again after each reconnect (a clean session forgets them), so a
    test watching the fleet keeps seeing it across a broker restart; the retained states come
    again with the new subscription."""

    def __init__(self, port: int, topics: list[str]) -> None:
        super().__init__(port)
        self.topics = topics

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        for topic in self.topics:
            client.subscribe(topic, 1)
        super()._on_connect(client, userdata, flags, reason, props)
