"""Simulated devices for the fleet benchmark: light MQTT clients that speak the device side of
the protocol (docs/fleet-rollout.md) and nothing else. Each subscribes to its group's desired
state and its own override, and answers a new desired version the way a device does: a
``downloading`` state, then after ``work_s`` (with jitter) ``serving`` it, or ``rolled back``
for the devices chosen to fail. They let the controller be measured against hundreds of
devices on one machine, where hundreds of daemons would not fit."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from edged.fleet import protocol


class SimDevice:
    def __init__(self, port: int, name: str, group: str, work_s: float, fails: bool, seed: int) -> None:
        self.name, self.group, self.work_s, self.fails = name, group, work_s, fails
        self.rng = random.Random(seed)
        self.version, self.phase, self.target, self.reason = "0.0.0", "serving", "", ""
        self.docs: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.connected = threading.Event()
        self.timers: list[threading.Timer] = []
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"sim-{name}", protocol=MQTTProtocolVersion.MQTTv5
        )
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.port = port

    def start(self) -> None:
        self.client.connect_async("127.0.0.1", self.port, 60)
        self.client.loop_start()

    def stop(self) -> None:
        for t in self.timers:
            t.cancel()
        self.client.publish(protocol.device_state("edged", self.name), b"", qos=1, retain=True).wait_for_publish(5)
        self.client.disconnect()
        self.client.loop_stop()

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        client.subscribe(protocol.group_desired("edged", self.group), qos=1)
        client.subscribe(protocol.device_desired("edged", self.name), qos=1)
        self._report()
        self.connected.set()

    def _report(self) -> None:
        doc = {
            "device": self.name,
            "group": self.group,
            "ts": round(time.time(), 3),
            "models": {
                "m": {"version": self.version, "target": self.target, "phase": self.phase, "reason": self.reason}
            },
        }
        self.client.publish(protocol.device_state("edged", self.name), json.dumps(doc).encode(), qos=1, retain=True)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            doc = json.loads(msg.payload) if msg.payload else {}
        except ValueError:
            return
        with self.lock:
            self.docs[msg.topic] = doc
            models: dict[str, Any] = {}
            for topic in (protocol.group_desired("edged", self.group), protocol.device_desired("edged", self.name)):
                models.update((self.docs.get(topic) or {}).get("models") or {})
            want = (models.get("m") or {}).get("version")
            if not want or want in (self.version, self.target):
                return
            self.target, self.phase, self.reason = want, "downloading", ""
            self._report()
            delay = self.work_s * (0.5 + self.rng.random())
            timer = threading.Timer(delay, self._done, (want,))
            self.timers.append(timer)
            timer.start()

    def _done(self, version: str) -> None:
        with self.lock:
            if version != self.target:
                return
            if self.fails:
                self.phase, self.reason = "rolled back", "failed its accuracy gate (simulated)"
            else:
                self.version, self.phase = version, "serving"
            self._report()
