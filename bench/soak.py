#!/usr/bin/env python3
"""Soak: mixed socket, shared-memory and MQTT clients against one edged, with a reload (SIGHUP)
and a broker restart in the middle; the daemon's RSS and open file descriptors sampled
throughout and fitted with a line.

  scripts/bench.sh soak [--seconds 600] [--out bench-results/soak.json]
  python -m bench soak --seconds 60

Clients run closed-loop, as fast as the daemon answers them (the benchmark's throughput on this
machine): socket clients send the tiny model's JSON (every 20th request a wrong shape, which must
be answered invalid_input), shared-memory clients send a 1x3x64x64 frame through a region they
registered once, MQTT clients keep a window of QoS 1 requests in flight on a persistent session.
At 1/3 of the run the config changes (tiny's queue depth) and edged gets SIGHUP; at 1/2 mosquitto
restarts (its persistence file keeps the sessions). Every answer is checked against the answer
edged gave before the soak began. Pass: 0 errors and 0 lost on good requests, RSS and fd slopes
flat over the second half of the run (after both events; the fitted growth under 2 % of RSS, or
4 MiB, and under one fd; the whole run's fit is reported too). If /metrics exposes
edged_loop_stall, its samples at the end are reported.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from bench.mqtt import make_sensor_model
from edged.client import Client
from edged.errors import EdgedError, InvalidInputError
from edged.tools.demo import make_tiny_mlp
from tests.helpers import DaemonProcess, wait_for, write_config
from tests.integration.mosquitto import Broker

DEVICE = "soak"
MQTT_WINDOW = 4
MQTT_TIMEOUT_S = 30.0
SAMPLE_S = 1.0
SETTLE_S = 5.0  # after the broker restart, before the flat part of the run is judged


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


# --- the daemon and its config -------------------------------------------------------------------


def config(work: Path, port: int, models: Path, queue_depth: int) -> Path:
    return write_config(
        work / "edged.toml",
        {
            "server": {"socket": str(work / "edged.sock")},
            "cache": {"dir": str(work / "cache")},
            "lifecycle": {"watch_files": False},
            "mqtt": {
                "enabled": True,
                "host": "127.0.0.1",
                "port": port,
                "device_id": DEVICE,
                "telemetry_interval_s": 5,
                "reconnect_min_s": 0.1,
                "reconnect_max_s": 1.0,
            },
            "models.tiny": {"path": str(models / "tiny.onnx"), "queue_depth": queue_depth},
            "models.sensor": {"path": str(models / "sensor.onnx")},
        },
    )


def sample(pid: int) -> tuple[int, int]:
    """(RSS bytes, open fds) of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def slope(samples: list[tuple[float, int, int]]) -> dict[str, Any]:
    """Least-squares lines through RSS and fds over time, and whether both are flat."""
    t = np.array([s[0] for s in samples])
    rss = np.array([s[1] for s in samples], dtype=np.float64)
    fds = np.array([s[2] for s in samples], dtype=np.float64)
    span = float(t[-1] - t[0]) if len(t) > 1 else 0.0
    rss_per_s = float(np.polyfit(t, rss, 1)[0]) if len(t) > 2 else 0.0
    fd_per_s = float(np.polyfit(t, fds, 1)[0]) if len(t) > 2 else 0.0
    rss_growth, fd_growth = rss_per_s * span, fd_per_s * span
    return {
        "samples": len(samples),
        "rss_mib_first_last": [round(rss[0] / 2**20, 1), round(rss[-1] / 2**20, 1)],
        "rss_slope_kib_per_min": round(rss_per_s * 60 / 1024, 1),
        "rss_fitted_growth_mib": round(rss_growth / 2**20, 2),
        "fds_first_last": [int(fds[0]), int(fds[-1])],
        "fd_slope_per_min": round(fd_per_s * 60, 3),
        "fd_fitted_growth": round(fd_growth, 2),
        "flat": bool(rss_growth < max(4 * 2**20, 0.02 * float(rss.mean())) and fd_growth < 1.0),
    }


# --- clients -------------------------------------------------------------------------------------


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


# --- the run -------------------------------------------------------------------------------------


def reference(sock: str, x: np.ndarray, frame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with Client(sock) as c:
        return c.infer("tiny", {"x": x})["probs"], c.infer("sensor", {"x": frame})["probs"]


def loop_stall(sock: str) -> list[str]:
    with Client(sock) as c:
        status, body, _ = c.request("GET", "/metrics")
    return [line for line in body.decode().splitlines() if status == 200 and re.match(r"edged_loop_stall", line)]


def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    models = work / "models"
    models.mkdir()
    make_tiny_mlp(models / "tiny.onnx")
    make_sensor_model(models / "sensor.onnx")
    broker = Broker(work / "broker")
    broker.start()
    cfg = config(work, broker.port, models, 64)
    d = DaemonProcess(cfg, work / "edged.sock", work / "edged.log")
    d.start(timeout=120)
    assert d.proc is not None
    sock = str(d.socket)
    try:
        rng = np.random.default_rng(7)
        x = rng.standard_normal((1, 16)).astype(np.float32)
        frame = rng.random((1, 3, 64, 64), dtype=np.float32)
        want_tiny, want_sensor = reference(sock, x, frame)
        tallies = {"socket": Tally(), "shm": Tally(), "mqtt": Tally()}
        ctx = multiprocessing.get_context("fork")  # before any thread of this process starts
        pstop, results = ctx.Event(), ctx.Queue()
        kinds = ["socket"] * args.socket + ["shm"] * args.shm
        procs = [
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
        stop = threading.Event()
        mqtts = [MqttClient(f"m{i}", broker.port, x, want_tiny, tallies["mqtt"]) for i in range(args.mqtt)]
        lost: list[int] = []
        threads = [threading.Thread(target=lambda m=m: lost.append(m.run(stop)), daemon=True) for m in mqtts]
        events: dict[str, Any] = {}
        samples: list[tuple[float, int, int]] = []
        t0 = time.monotonic()
        for p in procs:
            p.start()
        for t in threads:
            t.start()
        while (now := time.monotonic() - t0) < args.seconds:
            samples.append((now, *sample(d.proc.pid)))
            if "reload" not in events and now >= args.seconds / 3:
                config(work, broker.port, models, 65)
                os.kill(d.proc.pid, signal.SIGHUP)
                events["reload"] = {"at_s": round(now, 1)}
            if "broker_restart" not in events and now >= args.seconds / 2:
                started = time.monotonic()
                broker.restart()
                events["broker_restart"] = {"at_s": round(now, 1), "down_s": round(time.monotonic() - started, 2)}
            time.sleep(SAMPLE_S)  # the sampling period of a measurement, not a synchronisation
        stop.set()
        pstop.set()
        for _ in kinds:
            kind, ok, bad_ok, errs = results.get(timeout=MQTT_TIMEOUT_S + 30)
            tallies[kind].ok += ok
            tallies[kind].bad_ok += bad_ok
            tallies[kind].errors.update(errs)
        for p in procs:
            p.join(10)
        for t in threads:
            t.join(MQTT_TIMEOUT_S + 10)
        elapsed = time.monotonic() - t0
        wait_for(lambda: "reload done" in d.log(), 30, what="the reload to finish")
        events["reload"]["log"] = next(line for line in d.log().splitlines() if "reload done" in line)[24:]
        errors: Counter[str] = sum((t.errors for t in tallies.values()), Counter())
        answered = sum(t.ok + t.bad_ok for t in tallies.values())
        result = {
            "seconds": round(elapsed, 1),
            "clients": {"socket": args.socket, "shm": args.shm, "mqtt": args.mqtt},
            "good_answered": {kind: t.ok for kind, t in tallies.items()},
            "bad_answered_right": tallies["socket"].bad_ok,
            "requests_per_s": round(answered / elapsed, 1),
            "errors": sum(errors.values()),
            "error_kinds": dict(errors.most_common(10)),
            "mqtt_lost": sum(lost),
            "mqtt_answered_twice": sum(sum(v > 1 for v in m.replies.values()) for m in mqtts),
            "events": events,
            # Judged after the reload and the restart (each a step: the allocator keeps what the
            # swapped model and reconnection used), over the second half of the run.
            "daemon": slope([x for x in samples if x[0] >= args.seconds / 2 + SETTLE_S] or samples),
            "daemon_whole_run": slope(samples),
            "loop_stall": loop_stall(sock),
        }
    finally:
        rc = d.stop(timeout=60)
        broker.stop()
    result["daemon_exit"] = rc
    result["passed"] = bool(result["errors"] == 0 and result["mqtt_lost"] == 0 and result["daemon"]["flat"] and rc == 0)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--socket", type=int, default=2, help="socket clients (tiny model, JSON)")
    ap.add_argument("--shm", type=int, default=1, help="shared-memory clients (1x3x64x64 frame)")
    ap.add_argument("--mqtt", type=int, default=2, help="MQTT clients (tiny model, raw tensor, QoS 1)")
    ap.add_argument("--out", type=Path, default=Path("bench-results/soak.json"))
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs) and print its path")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="edged-soak-"))
    try:
        result = soak(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if args.keep:
        print(f"work directory: {work}")
    return 0 if result["passed"] else 1
