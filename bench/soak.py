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
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.mqtt import make_sensor_model
from bench.soak_clients import DEVICE, MQTT_TIMEOUT_S, MqttClient, Tally, client_processes
from edged.client import Client
from edged.tools.demo import make_tiny_mlp
from tests.helpers import DaemonProcess, wait_for, write_config
from tests.integration.mosquitto import Broker

SAMPLE_S = 1.0
SETTLE_S = 5.0  # after the broker restart, before the flat part of the run is judged


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


# --- the run -------------------------------------------------------------------------------------


def reference(sock: str, x: np.ndarray, frame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with Client(sock) as c:
        return c.infer("tiny", {"x": x})["probs"], c.infer("sensor", {"x": frame})["probs"]


def loop_stall(sock: str) -> list[str]:
    with Client(sock) as c:
        status, body, _ = c.request("GET", "/metrics")
    return [line for line in body.decode().splitlines() if status == 200 and re.match(r"edged_loop_stall", line)]


def _start(work: Path) -> tuple[Path, Broker, DaemonProcess]:
    """The two models written under ``work``, mosquitto started and edged started on both."""
    models = work / "models"
    models.mkdir()
    make_tiny_mlp(models / "tiny.onnx")
    make_sensor_model(models / "sensor.onnx")
    broker = Broker(work / "broker")
    broker.start()
    cfg = config(work, broker.port, models, 64)
    d = DaemonProcess(cfg, work / "edged.sock", work / "edged.log")
    d.start(timeout=120)
    return models, broker, d


def _sample_with_events(
    args: argparse.Namespace, work: Path, models: Path, broker: Broker, pid: int, t0: float
) -> tuple[dict[str, Any], list[tuple[float, int, int]]]:
    """Sample the daemon until the run's end, reloading it at 1/3 and restarting the broker at
    1/2; the events and the samples."""
    events: dict[str, Any] = {}
    samples: list[tuple[float, int, int]] = []
    while (now := time.monotonic() - t0) < args.seconds:
        samples.append((now, *sample(pid)))
        if "reload" not in events and now >= args.seconds / 3:
            config(work, broker.port, models, 65)
            os.kill(pid, signal.SIGHUP)
            events["reload"] = {"at_s": round(now, 1)}
        if "broker_restart" not in events and now >= args.seconds / 2:
            started = time.monotonic()
            broker.restart()
            events["broker_restart"] = {"at_s": round(now, 1), "down_s": round(time.monotonic() - started, 2)}
        time.sleep(SAMPLE_S)  # the sampling period of a measurement, not a synchronisation
    return events, samples


def _collect(
    kinds: list[str], results: Any, tallies: dict[str, Tally], procs: list[Any], threads: list[threading.Thread]
) -> None:
    """The client processes' tallies added to ``tallies``; every client process and thread joined."""
    for _ in kinds:
        kind, ok, bad_ok, errs = results.get(timeout=MQTT_TIMEOUT_S + 30)
        tallies[kind].ok += ok
        tallies[kind].bad_ok += bad_ok
        tallies[kind].errors.update(errs)
    for p in procs:
        p.join(10)
    for t in threads:
        t.join(MQTT_TIMEOUT_S + 10)


def _result(
    args: argparse.Namespace,
    elapsed: float,
    tallies: dict[str, Tally],
    lost: list[int],
    mqtts: list[MqttClient],
    events: dict[str, Any],
    samples: list[tuple[float, int, int]],
    sock: str,
) -> dict[str, Any]:
    """The run's figures, before the daemon's exit and the verdict."""
    errors: Counter[str] = sum((t.errors for t in tallies.values()), Counter())
    answered = sum(t.ok + t.bad_ok for t in tallies.values())
    return {
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


def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    models, broker, d = _start(work)
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
        procs = client_processes(ctx, kinds, sock, (x, want_tiny), (frame, want_sensor), pstop, results)
        stop = threading.Event()
        mqtts = [MqttClient(f"m{i}", broker.port, x, want_tiny, tallies["mqtt"]) for i in range(args.mqtt)]
        lost: list[int] = []
        threads = [threading.Thread(target=lambda m=m: lost.append(m.run(stop)), daemon=True) for m in mqtts]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        for t in threads:
            t.start()
        events, samples = _sample_with_events(args, work, models, broker, d.proc.pid, t0)
        stop.set()
        pstop.set()
        _collect(kinds, results, tallies, procs, threads)
        elapsed = time.monotonic() - t0
        wait_for(lambda: "reload done" in d.log(), 30, what="the reload to finish")
        events["reload"]["log"] = next(line for line in d.log().splitlines() if "reload done" in line)[24:]
        result = _result(args, elapsed, tallies, lost, mqtts, events, samples, sock)
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
