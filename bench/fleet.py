#!/usr/bin/env python3
"""The fleet: time from publish to every device serving, heartbeat bytes per device per minute,
and the controller against 200 simulated devices, on two bridged mosquittos on this machine.

  python -m bench fleet [--devices 8] [--sims 200] [--out bench-results/fleet.json]

1. Real daemons (``--devices``, the tiny MLP on ONNX Runtime) follow a device-side broker bridged
   to a central one. A signed bundle is published once to the whole group (one stage of 100%),
   then the next version in stages of 1, 10 and 100% with ``edged fleet rollout``'s controller,
   alternating for ``--rounds``; both times are from the first publish to the last device
   reporting ``serving``, taken side by side in this run (their ratio is what staging costs).
   Each device's own build time comes from its reported state.
2. Heartbeats: the daemons send one every ``--heartbeat-s`` seconds here; the payloads received
   give the bytes a device sends per minute at the default interval (60 s), payload and MQTT
   framing (fixed header, topic), against the 1 KB a minute budget.
3. ``--sims`` simulated devices (bench/fleet_sim.py: light clients speaking the protocol) on the
   device-side broker: a rollout in stages 1, 10, 100% that succeeds, and one where 5% of the
   devices fail, which must pause at its first stage past 2%.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.fleet_sim import SimDevice  # noqa: E402
from edged.fleet import desired, protocol  # noqa: E402
from edged.fleet.controller import Plan, Rollout  # noqa: E402
from edged.fleet.view import BrokerAddress, FleetView  # noqa: E402
from edged.tools.demo import make_tiny_mlp  # noqa: E402
from tests.fleet_keys import KeyPair, make_key  # noqa: E402
from tests.integration import fleet_net  # noqa: E402
from tests.integration.mosquitto import Broker  # noqa: E402

DEFAULT_HEARTBEAT_S = 60.0


def serving(view: FleetView, version: str, names: list[str]) -> bool:
    states = view.states
    return all(((states.get(n) or {}).get("models") or {}).get("m", {}).get("version") == version for n in names)


def real_fleet(
    root: Path, central: Broker, edge: Broker, count: int, heartbeat_s: float, rounds: int
) -> dict[str, Any]:
    key = make_key(root, "release")
    model = make_tiny_mlp(root / "m0.onnx")
    devices = {
        f"dev-{i}": fleet_net.device(
            root / f"dev-{i}", f"dev-{i}", edge.port, key.public, model, {"heartbeat_interval_s": heartbeat_s}
        )
        for i in range(count)
    }
    beats: list[int] = []
    out: dict[str, Any] = {"devices": count}
    try:
        for d in devices.values():
            d.start(wait_ready=False)
        for d in devices.values():
            d.wait_ready(180)
        addr = BrokerAddress("127.0.0.1", central.port)
        with FleetView(addr, "edged", fleet_net.GROUP) as view:
            view.client.message_callback_add(
                protocol.heartbeat("edged", fleet_net.GROUP, "+"),
                lambda c, u, m: beats.append(len(m.topic) + len(m.payload)),
            )
            view.wait_connected(30)
            view.client.subscribe(protocol.heartbeat("edged", fleet_net.GROUP, "+"), qos=0)
            view.wait(lambda: len(view.states) == count, 60)
            _release_rounds(root, view, key, sorted(devices), rounds, out)
            out["build_s"] = sorted(float(s["models"]["m"]["build_s"] or 0) for s in view.snapshot().values())
            out["state_bytes"] = max(len(json.dumps(s)) for s in view.snapshot().values())
            view.wait(lambda: len(beats) >= 2 * count, heartbeat_s * 4)
    finally:
        for d in devices.values():
            d.stop(15)
            d.kill()
    wire = [b + 4 for b in beats]  # + fixed header (2) and topic length (2); QoS 0 has no packet id
    out["heartbeats"] = len(beats)
    out["heartbeat_wire_bytes_median"] = statistics.median(wire) if wire else None
    out["heartbeat_bytes_per_minute_default"] = (
        round(statistics.median(wire) * 60 / DEFAULT_HEARTBEAT_S, 1) if wire else None
    )
    return out


def _release_rounds(
    root: Path, view: FleetView, key: KeyPair, names: list[str], rounds: int, out: dict[str, Any]
) -> None:
    """Each round a release published to the whole group at once, then the next one through a
    staged rollout; their times (and the medians) into ``out``."""
    one, staged, stage_times = [], [], []
    for r in range(rounds):  # alternating, so that neither gets the warm-up alone
        v1, v2 = f"{2 * r + 1}.0.0", f"{2 * r + 2}.0.0"
        rel = fleet_net.release(root / "rel", v1, key.private, hidden=40 + 2 * r)
        t0 = time.monotonic()
        view.publish(protocol.group_desired("edged", fleet_net.GROUP), desired.encode({"m": rel.target()}))
        view.wait(lambda v=v1: serving(view, v, names), 300)
        one.append(round(time.monotonic() - t0, 3))
        rel = fleet_net.release(root / "rel", v2, key.private, hidden=41 + 2 * r)
        plan = Plan("m", rel.target(), (1.0, 10.0, 100.0), 0.02, 300.0, discover_s=0.5)
        t0 = time.monotonic()
        res = Rollout(view, plan, lambda line: None).run()
        staged.append(round(time.monotonic() - t0, 3))
        stage_times.append(res.stage_times)
        assert res.done, res.reason
    out.update(one_publish_s=one, staged_s=staged, stage_times_s=stage_times)
    out["one_publish_median_s"] = statistics.median(one)
    out["staged_median_s"] = statistics.median(staged)


def simulated(central: Broker, edge: Broker, count: int, failing: float) -> dict[str, Any]:
    group = "sim"
    # Spread evenly, none among the first stage's: the rollout pauses in its second stage.
    bad = set(range(7, count, int(1 / failing))) if failing else set()
    sims = [SimDevice(edge.port, f"sim-{i:03d}", group, 0.3, i in bad, i) for i in range(count)]
    started = time.monotonic()
    for s in sims:
        s.start()
    for s in sims:
        s.connected.wait(60)
    out: dict[str, Any] = {"devices": count, "failing": len(bad), "connect_s": round(time.monotonic() - started, 3)}
    try:
        with FleetView(BrokerAddress("127.0.0.1", central.port), "edged", group) as view:
            view.wait_connected(30)
            t0 = time.monotonic()
            view.wait(lambda: len(view.states) == count, 60)
            out["discover_s"] = round(time.monotonic() - t0, 3)
            target = desired.Target("/bundles/m.tar", "ab" * 32, f"1.{len(bad)}.0", 1000)
            plan = Plan("m", target, (1.0, 10.0, 100.0), 0.02, 120.0, discover_s=0.5)
            t0 = time.monotonic()
            res = Rollout(view, plan, lambda line: None).run()
            out.update(
                total_s=round(time.monotonic() - t0, 3),
                done=res.done,
                reason=res.reason,
                stage_times_s=res.stage_times,
                serving=len(res.serving),
                failed=len(res.failed),
            )
    finally:
        for s in sims:
            s.stop()
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fleet")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--sims", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2, help="one-stage and staged rollouts, alternating")
    ap.add_argument("--heartbeat-s", type=float, default=2.0, help="the daemons' heartbeat interval in this run")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "fleet.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="edged-bench-fleet-") as tmp:
        root = Path(tmp)
        central, edge = Broker(root / "central"), Broker(root / "edge")
        fleet_net.bridge(edge, central)
        central.start()
        edge.start()
        try:
            real = real_fleet(root, central, edge, args.devices, args.heartbeat_s, args.rounds)
            ok = simulated(central, edge, args.sims, 0.0)
            failing = simulated(central, edge, args.sims, 0.05)
        finally:
            edge.stop()
            central.stop()
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "real": real,
        "simulated": ok,
        "simulated_failing": failing,
        "staged_over_one_publish": round(real["staged_median_s"] / real["one_publish_median_s"], 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(
        f"\n{args.devices} daemons: publish to all serving {real['one_publish_median_s']} s in one stage, "
        f"{real['staged_median_s']} s in 1/10/100% stages (x{result['staged_over_one_publish']}); "
        f"heartbeat {real['heartbeat_bytes_per_minute_default']} B/min/device at 60 s (budget 1024, "
        f"x{round((real['heartbeat_bytes_per_minute_default'] or 0) / 1024, 3)}); "
        f"{args.sims} simulated: done in {ok['total_s']} s; with {failing['failing']} failing: {failing['reason']}"
    )
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
