#!/usr/bin/env python3
"""MQTT round trips through edged against a raw paho echo, through the same broker, in one run.

  scripts/bench.sh mqtt [--rounds 2000] [--qos 1] [--out bench-results/mqtt.json]

A mosquitto of its own (set_tcp_nodelay true) on a free loopback port; edged as a subprocess
with two models: the tiny MLP (1x16 -> 1x4) and a small sensor CNN on a 1x3x64x64 FP32 frame
(48 KiB, a thumbnail-sized camera or depth patch). The floor is a separate process running a
plain paho client that publishes every request's payload back to its Response Topic with the
Correlation Data: the broker and both clients' costs, without edged. Cases:

  tiny/json     the HTTP infer JSON body           vs echo of the same bytes
  tiny/raw      64 raw bytes + dtype/shape props   vs echo of the same bytes
  sensor/raw    49152 raw bytes + dtype/shape      vs echo of the same bytes
  sensor/json   the same frame as JSON             vs echo of the same bytes

Echo and edged take turns in blocks of 25 round trips per case (who goes first alternating), so
both see the same noise over the run. The requester drives its paho client from one thread (no network
thread), MQTT 5, TCP_NODELAY. Target: edged adds at most 0.3 ms to the echo's median
for the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

REPO = Path(__file__).resolve().parent.parent

from edged.tools.demo import make_tiny_mlp  # noqa: E402
from tests.helpers import DaemonProcess, write_config  # noqa: E402
from tests.integration.mosquitto import Broker  # noqa: E402

TARGET_MS = 0.3
DEVICE = "bench"


def make_sensor_model(path: Path) -> Path:
    """1x3x64x64 FP32 -> 1x4: conv 3x3/2 to 8 channels, ReLU, global average, linear, softmax."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    w = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.2, "w")
    b = numpy_helper.from_array(np.zeros(8, np.float32), "b")
    fc = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "fc")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["r"]),
            helper.make_node("GlobalAveragePool", ["r"], ["g"]),
            helper.make_node("Flatten", ["g"], ["f"]),
            helper.make_node("MatMul", ["f", "fc"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["probs"], axis=1),
        ],
        "sensor",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 64, 64])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 4])],
        [w, b, fc],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _nodelay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# --- the echo (a separate process) ----------------------------------------------------------------


def run_echo(port: int, qos: int) -> None:
    """Publish each request's payload to its Response Topic with its Correlation Data."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-echo", protocol=MQTTProtocolVersion.MQTTv5)
    client.on_socket_open = _nodelay

    def on_message(c: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.CorrelationData = msg.properties.CorrelationData  # type: ignore[union-attr]
        c.publish(
            msg.properties.ResponseTopic,
            msg.payload,
            qos=msg.qos,  # type: ignore[union-attr]
            properties=props,
        )

    def on_connect(c: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        c.subscribe("bench/echo/#", qos)
        c.publish("bench/echo-ready", "1", qos=1, retain=True)

    client.on_message = on_message
    client.on_connect = on_connect
    client.connect("127.0.0.1", port)
    client.loop_forever()


# --- the requester ------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    model: str
    payload: bytes
    user: list[tuple[str, str]]
    content_type: str


class Requester:
    """One paho client driven from this thread: publish, then read until the reply is in."""

    def __init__(self, port: int, qos: int) -> None:
        self.qos = qos
        self.got: bytes | None = None
        self.payload = b""
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id="bench-req", protocol=MQTTProtocolVersion.MQTTv5
        )
        self.client.on_socket_open = _nodelay
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.retained: set[str] = set()
        self.client.subscribe([("bench/reply", qos), ("bench/echo-ready", 1)])
        self._until(lambda: "bench/echo-ready" in self.retained, 30)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.topic == "bench/reply":
            self.got = msg.properties.CorrelationData  # type: ignore[union-attr]
            self.payload = bytes(msg.payload)
        else:
            self.retained.add(msg.topic)

    def _until(self, cond: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError("no reply within the deadline")
            self.client.loop(timeout=0.5)

    def roundtrip(self, topic: str, case: Case, corr: bytes) -> float:
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.ResponseTopic = "bench/reply"
        props.CorrelationData = corr
        if case.content_type:
            props.ContentType = case.content_type
        if case.user:
            props.UserProperty = case.user
        self.got = None
        t0 = time.perf_counter()
        self.client.publish(topic, case.payload, qos=self.qos, properties=props)
        self._until(lambda: self.got == corr, 10)
        return time.perf_counter() - t0


def cases() -> list[Case]:
    rng = np.random.default_rng(5)
    tiny = rng.standard_normal((1, 16)).astype(np.float32)
    frame = rng.standard_normal((1, 3, 64, 64)).astype(np.float32)

    def as_json(x: np.ndarray) -> bytes:
        return json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()}]}
        ).encode()

    def raw_props(x: np.ndarray) -> list[tuple[str, str]]:
        return [("dtype", "FP32"), ("shape", ",".join(map(str, x.shape)))]

    octet = "application/octet-stream"
    return [
        Case("tiny/json", "tiny", as_json(tiny), [], "application/json"),
        Case("tiny/raw", "tiny", tiny.tobytes(), raw_props(tiny), octet),
        Case("sensor/raw", "sensor", frame.tobytes(), raw_props(frame), octet),
        Case("sensor/json", "sensor", as_json(frame), [], "application/json"),
    ]


def measure(
    req: Requester, all_cases: list[Case], rounds: int, warmup: int, block: int
) -> dict[str, dict[str, list[float]]]:
    """Blocks of ``block`` round trips, echo and edged taking turns to go first. Strictly
    alternating single requests would time each one against the other's tail (the broker and
    the other client still acknowledging on the same cores) rather than against the noise."""
    times: dict[str, dict[str, list[float]]] = {c.name: {"echo": [], "edged": []} for c in all_cases}
    blocks = -(-(warmup + rounds) // block)
    for b in range(blocks):
        for case in all_cases:
            pair = [("echo", f"bench/echo/{case.name}"), ("edged", f"edged/{DEVICE}/models/{case.model}/infer")]
            if b % 2:
                pair.reverse()
            for who, topic in pair:
                for i in range(b * block, (b + 1) * block):
                    dt = req.roundtrip(topic, case, f"{who}-{case.name}-{i}".encode())
                    if who == "edged" and b'"code"' in req.payload[:200]:
                        raise RuntimeError(f"{case.name}: edged answered an error: {req.payload[:300]!r}")
                    if i >= warmup:
                        times[case.name][who].append(dt)
    return times


def summarize(times: dict[str, dict[str, list[float]]], payloads: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, by in times.items():
        row: dict[str, Any] = {"request_bytes": payloads[name]}
        for who, xs in by.items():
            ms = np.asarray(xs) * 1000
            row[who] = {
                "p50_ms": round(float(np.percentile(ms, 50)), 4),
                "p99_ms": round(float(np.percentile(ms, 99)), 4),
                "mean_ms": round(float(ms.mean()), 4),
                "n": len(xs),
            }
        row["added_p50_ms"] = round(row["edged"]["p50_ms"] - row["echo"]["p50_ms"], 4)
        row["added_p99_ms"] = round(row["edged"]["p99_ms"] - row["echo"]["p99_ms"], 4)
        out[name] = row
    return out


def print_table(result: dict[str, Any]) -> None:
    head = (
        f"{'case':<12} {'bytes':>7} {'echo p50':>9} {'echo p99':>9} {'edged p50':>10} "
        f"{'edged p99':>10} {'added p50':>10}"
    )
    print(head)
    print("-" * len(head))
    for name, row in result["cases"].items():
        print(
            f"{name:<12} {row['request_bytes']:>7} {row['echo']['p50_ms']:>9.3f} {row['echo']['p99_ms']:>9.3f} "
            f"{row['edged']['p50_ms']:>10.3f} {row['edged']['p99_ms']:>10.3f} {row['added_p50_ms']:>10.3f}"
        )
    worst = max(result["cases"]["tiny/json"]["added_p50_ms"], result["cases"]["tiny/raw"]["added_p50_ms"])
    verdict = "meets" if worst <= TARGET_MS else "MISSES"
    print(f"\ntiny model: edged adds {worst:.3f} ms to the echo's median (target <= {TARGET_MS} ms): {verdict}")


def start_edged(work: Path, port: int) -> DaemonProcess:
    make_tiny_mlp(work / "tiny.onnx")
    make_sensor_model(work / "sensor.onnx")
    config = write_config(
        work / "edged.toml",
        {
            "server": {"socket": str(work / "edged.sock"), "log_level": "warning"},
            "cache": {"dir": str(work / "cache")},
            "mqtt": {
                "enabled": True,
                "host": "127.0.0.1",
                "port": port,
                "device_id": DEVICE,
                "telemetry_interval_s": 0,
            },
            "models.tiny": {"path": str(work / "tiny.onnx")},
            "models.sensor": {"path": str(work / "sensor.onnx")},
        },
    )
    return DaemonProcess(config, work / "edged.sock", work / "edged.log").start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--block", type=int, default=25, help="round trips per turn (interleaving)")
    ap.add_argument("--qos", type=int, choices=(0, 1), default=1)
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "mqtt.json")
    ap.add_argument("--echo", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the echo process
    args = ap.parse_args(argv)
    if args.echo:
        run_echo(args.echo, args.qos)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-mqtt-") as tmp:
        work = Path(tmp)
        broker = Broker(work / "broker")
        broker.start()
        echo = subprocess.Popen(
            [sys.executable, "-m", "bench.mqtt", "--echo", str(broker.port), "--qos", str(args.qos)], cwd=REPO
        )
        daemon = start_edged(work, broker.port)
        try:
            req = Requester(broker.port, args.qos)
            all_cases = cases()
            times = measure(req, all_cases, args.rounds, args.warmup, args.block)
        finally:
            daemon.stop()
            echo.terminate()
            echo.wait(10)
            broker.stop()
    result = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "paho": mqtt.__version__ if hasattr(mqtt, "__version__") else "",
            "broker": "mosquitto (set_tcp_nodelay true)",
        },
        "qos": args.qos,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "block": args.block,
        "cases": summarize(times, {c.name: len(c.payload) for c in all_cases}),
        "target_added_p50_ms": TARGET_MS,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
