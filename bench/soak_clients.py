"""The clients of the soak (bench/soak.py), each driving edged closed-loop and counting what it
got back in a ``Tally``: socket clients (the tiny model's JSON, every 20th request a wrong shape),
shared-memory clients (a frame through a region registered once), each of those in a process of
its own, and MQTT clients keeping a window of QoS 1 requests in flight on a persistent session.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edged.client import Client
from edged.errors import EdgedError, InvalidInputError

DEVICE = "soak"
MQTT_WINDOW = 4
MQTT_TIMEOUT_S = 30.0


@dataclass
class Tally:
    ok: int = 0
    bad_ok: int = 0  # bad requests answered with the right error
    errors: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, ok: bool, what: str = "", bad: bool = False) -> None:
        with self.lock:
            if ok:
                if bad:
                    self.bad_ok += 1
                else:
                    self.ok += 1
            else:
                self.errors[what[:120]] += 1


def socket_client(sock: str, x: np.ndarray, want: np.ndarray, tally: Tally, stop: Any) -> None:
    bad = np.zeros((1, 15), np.float32)
    with Client(sock, timeout=60) as c:
        n = 0
        while not stop.is_set():
            n += 1
            if n % 20 == 0:
                try:
                    c.infer("tiny", {"x": bad})
                    tally.add(False, "bad request answered ok", bad=True)
                except InvalidInputError:
                    tally.add(True, bad=True)
                except Exception as e:
                    tally.add(False, f"bad request: {type(e).__name__}: {e}")
                continue
            try:
                out = c.infer("tiny", {"x": x})["probs"]
                tally.add(bool(np.allclose(out, want, rtol=1e-5)), "socket: wrong answer")
            except (EdgedError, OSError) as e:
                tally.add(False, f"socket: {type(e).__name__}: {e}")


def shm_client(sock: str, frame: np.ndarray, want: np.ndarray, tally: Tally, stop: Any) -> None:
    with Client(sock, timeout=60) as c:
        while not stop.is_set():
            try:
                out = c.infer_shm("sensor", {"x": frame})["probs"]
                tally.add(bool(np.allclose(out, want, rtol=1e-5)), "shm: wrong answer")
            except (EdgedError, OSError) as e:
                tally.add(False, f"shm: {type(e).__name__}: {e}")


def _process(kind: str, target: Any, args: tuple[Any, ...], stop: Any, results: Any) -> None:
    """A client in a process of its own (one Python process cannot drive the daemon at its
    throughput: the GIL); its tally goes back through ``results``."""
    tally = Tally()
    try:
        target(*args, tally, stop)
    except Exception as e:  # a client that dies is an error of the run, not a hang
        tally.add(False, f"client died: {type(e).__name__}: {e}")
    results.put((kind, tally.ok, tally.bad_ok, dict(tally.errors)))


class MqttClient:
    """QoS 1 requests with a window in flight, on a persistent session (its own client id)."""

    def __init__(self, name: str, port: int, x: np.ndarray, want: np.ndarray, tally: Tally) -> None:
        self.name, self.x, self.want, self.tally = name, x, want, tally
        self.reply_topic = f"soak/{name}/reply"
        self.topic = f"edged/{DEVICE}/models/tiny/infer"
        self.cond = threading.Condition()
        self.pending: dict[bytes, float] = {}
        self.replies = Counter[bytes]()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"soak-{name}-{os.getpid()}", protocol=MQTTProtocolVersion.MQTTv5
        )
        self.client.reconnect_delay_set(0.1, 1)  # type: ignore[arg-type]
        self.client.on_message = self._on_message
        self.client.on_socket_open = lambda c, u, s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 600
        # A persistent session from the start (a fresh client id): mosquitto 2.0 does not save
        # a session begun with clean start across its restart, and the soak restarts it.
        self.client.connect("127.0.0.1", port, 30, clean_start=False, properties=props)
        self.client.subscribe(self.reply_topic, 1)
        self.client.loop_start()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        corr = getattr(msg.properties, "CorrelationData", b"")
        with self.cond:
            self.replies[corr] += 1
            if self.replies[corr] > 1 or corr not in self.pending:
                return  # an answer sent again after a reconnect (QoS 1 is at least once)
            del self.pending[corr]
            self.cond.notify_all()
        code = dict(getattr(msg.properties, "UserProperty", ())).get("code")
        if code:
            self.tally.add(False, f"mqtt: {code}: {bytes(msg.payload)[:80]!r}")
            return
        out = np.frombuffer(msg.payload, np.float32).reshape(1, 4)
        self.tally.add(bool(np.allclose(out, self.want, rtol=1e-5)), "mqtt: wrong answer")

    def run(self, stop: threading.Event) -> int:
        """Send until stopped; then wait for the answers in flight. Returns how many were lost."""
        n = 0
        while not stop.is_set():
            with self.cond:
                self.cond.wait_for(lambda: len(self.pending) < MQTT_WINDOW or stop.is_set(), 1.0)
                if len(self.pending) >= MQTT_WINDOW:
                    continue
                n += 1
                corr = f"{self.name}-{n}".encode()
                self.pending[corr] = time.monotonic()
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            props.ResponseTopic, props.CorrelationData = self.reply_topic, corr
            props.ContentType = "application/octet-stream"
            props.UserProperty = [("dtype", "FP32"), ("shape", "1,16")]
            self.client.publish(self.topic, self.x.tobytes(), qos=1, properties=props)
        with self.cond:
            self.cond.wait_for(lambda: not self.pending, MQTT_TIMEOUT_S)
            lost = len(self.pending)
        self.client.disconnect()
        self.client.loop_stop()
        return lost


def client_processes(
    ctx: Any,
    kinds: list[str],
    sock: str,
    tiny: tuple[np.ndarray, np.ndarray],
    sensor: tuple[np.ndarray, np.ndarray],
    pstop: Any,
    results: Any,
) -> list[Any]:
    """A process (not started) per socket or shared-memory client; ``tiny`` and ``sensor`` are
    each model's input and the answer it must get."""
    x, want_tiny = tiny
    frame, want_sensor = sensor
    return [
        ctx.Process(
            target=_process,
            args=(
                kind,
                socket_client if kind == "socket" else shm_client,
                (sock, x, want_tiny) if kind == "socket" else (sock, frame, want_sensor),
                pstop,
                results,
            ),
            daemon=True,
        )
        for kind in kinds
    ]
