"""The edged daemon as a subprocess with an [mqtt] table aimed at a test broker, and the request
and reply helpers of the tests that speak MQTT to it.

Many integration modules start their own ``Edged`` (MQTT, HTTP edges, deadlines, error parity), so
it lives here, apart from any one test module: a test module importing another would carry that
module's fixtures and tests along.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers import DaemonProcess, write_config
from tests.integration.mosquitto import Received


class Edged(DaemonProcess):
    """``python -m edged serve`` with an [mqtt] table pointing at the test broker."""

    def __init__(
        self,
        directory: Path,
        port: int,
        device: str,
        models: Mapping[str, Mapping[str, Any]],
        cache: Path,
        extra: Mapping[str, Mapping[str, Any]] | None = None,
        env: dict[str, str] | None = None,
        **mqtt_keys: Any,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.device = device
        mqtt = {
            "enabled": True,
            "host": "127.0.0.1",
            "port": port,
            "device_id": device,
            "reconnect_min_s": 0.05,
            "reconnect_max_s": 0.5,
            **mqtt_keys,
        }
        tables: dict[str, dict[str, Any]] = {
            "server": {"socket": str(directory / "edged.sock"), "log_level": "debug"},
            "cache": {"dir": str(cache)},
            "build": {"block_ready": True},  # engines built before READY=1
            "mqtt": {k: v for k, v in mqtt.items() if not isinstance(v, dict)},
        }
        tables.update({f"mqtt.{k}": v for k, v in mqtt.items() if isinstance(v, dict)})
        for key, values in (extra or {}).items():
            tables[key] = {**tables.get(key, {}), **values}
        self.tables = tables
        self.models = dict(models)
        self.directory = directory
        self.write_models(models)
        super().__init__(directory / "edged.toml", directory / "edged.sock", directory / "edged.log", env=env)

    def write_models(self, models: Mapping[str, Mapping[str, Any]]) -> None:
        """(Re)write the config with these models; the rest stays as constructed."""
        tables = {k: v for k, v in self.tables.items() if not k.startswith("models.")}
        for name, m in models.items():
            key = f'"{name}"' if "." in name else name  # a TOML key with a dot is quoted
            tables[f"models.{key}"] = {k: v for k, v in m.items() if not isinstance(v, dict)}
            for sub, values in m.items():
                if isinstance(values, dict):
                    tables[f"models.{key}.{sub}"] = values
        self.tables = tables
        write_config(self.directory / "edged.toml", tables)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics, 0 when the series does not exist yet."""
        with self.client() as c:
            status, body, _ = c.request("GET", "/metrics")
        assert status == 200
        want = sorted(f'{k}="{v}"' for k, v in labels.items())
        for line in body.decode().splitlines():
            m = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
            if m and m.group(1) == name and sorted(m.group(2).split(",")) == want:
                return float(m.group(3))
        return 0.0


def json_request(x: np.ndarray, rid: str = "", **extra: Any) -> bytes:
    doc: dict[str, Any] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()}],
        **extra,
    }
    if rid:
        doc["id"] = rid
    return json.dumps(doc).encode()


def probs(reply: Received) -> np.ndarray:
    out = reply.json()["outputs"][0]
    assert out["name"] == "probs" and out["datatype"] == "FP32"
    arr: np.ndarray = np.asarray(out["data"], np.float32).reshape(out["shape"])
    return arr


def code_of(r: Received) -> str:
    return str(r.json().get("code", "ok")) if r.content_type == "application/json" else "ok"
