"""``edged fleet rollout`` and ``edged fleet status``: the operator's side, talking only to the
broker (edged/cli.py adds them; docs/fleet-rollout.md describes them). The MQTT client and the
bundle reader are imported when a command runs, so that every other ``edged`` command starts
without them."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edged.fleet import desired
    from edged.fleet.view import BrokerAddress


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("fleet", help="roll out bundles to a fleet and watch it, over MQTT")
    fleet = p.add_subparsers(dest="fleet_command", required=True)
    r = fleet.add_parser("rollout", help="publish a bundle to a group in stages; pause when too many fail")
    r.add_argument("bundle", type=Path, help="the bundle archive (tar) to roll out")
    r.add_argument("--url", default="", help="where devices fetch it (default: the archive's absolute path)")
    r.add_argument("--stages", default="1,10,100", help="percentages of the group, in order (default 1,10,100)")
    r.add_argument("--max-failures", default="2%", help="pause past this share of failed devices (default 2%%)")
    r.add_argument("--stage-timeout", type=float, default=1800.0, help="seconds a stage may take (default 1800)")
    r.add_argument("--trust", action="append", default=[], help="check the bundle's signature against this key first")
    r.set_defaults(fn=cmd_rollout)
    s = fleet.add_parser("status", help="the group's devices, versions and phases at a glance")
    s.add_argument("--json", action="store_true")
    s.add_argument("--wait", type=float, default=1.0, help="seconds of quiet that end the retained messages")
    s.set_defaults(fn=cmd_status)
    for sp in (r, s):
        sp.add_argument("--group", required=True)
        sp.add_argument("--broker", default=os.environ.get("EDGED_FLEET_BROKER", "localhost:1883"), help="HOST:PORT")
        sp.add_argument("--prefix", default="edged", help="the devices' mqtt.topic_prefix (default edged)")
        sp.add_argument("--username", default="")
        sp.add_argument("--ca", default="", help="CA file: connect with TLS")
        sp.add_argument("--cert", default="")
        sp.add_argument("--key", default="")


def _address(args: argparse.Namespace) -> BrokerAddress:
    from edged.fleet.view import BrokerAddress

    host, _, port = args.broker.rpartition(":") if ":" in args.broker else (args.broker, "", "1883")
    password = os.environ.get("EDGED_FLEET_PASSWORD", "")
    return BrokerAddress(host or "localhost", int(port), args.username, password, args.ca, args.cert, args.key)


def _target(args: argparse.Namespace) -> tuple[str, desired.Target]:
    """The model name and the desired entry for the bundle (read here, before anything is sent)."""
    from edged.fleet import desired
    from edged.fleet.bundle import open_bundle

    path = args.bundle.resolve()
    if not path.is_file():
        raise ValueError(f"{path}: a rollout sends one archive (make it with tar from the bundle's folder)")
    with tempfile.TemporaryDirectory(prefix="edged-rollout-") as tmp:
        bundle = open_bundle(
            path, [Path(t) for t in args.trust], require_signed=bool(args.trust), extract_to=Path(tmp) / "b"
        )
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    t = desired.Target(args.url or str(path), h.hexdigest(), bundle.version, path.stat().st_size)
    desired.check_target(bundle.name, t, t.size)
    return bundle.name, t


def cmd_rollout(args: argparse.Namespace) -> int:
    from edged.fleet import desired
    from edged.fleet.bundle import BundleRefused
    from edged.fleet.controller import Plan, Rollout, parse_fraction, parse_stages
    from edged.fleet.view import FleetView

    try:
        stages, share = parse_stages(args.stages), parse_fraction(args.max_failures)
        model, target = _target(args)
    except (ValueError, desired.DesiredRefused, BundleRefused) as e:
        print(f"edged fleet rollout: {e}", file=sys.stderr)
        return 2
    plan = Plan(model, target, stages, share, args.stage_timeout)
    with FleetView(_address(args), args.prefix, args.group) as view:
        if not view.wait_connected(30):
            print(f"edged fleet rollout: cannot reach the broker at {args.broker}", file=sys.stderr)
            return 1
        out = Rollout(view, plan, lambda line: print(line, flush=True)).run()
    print(out.reason)
    return 0 if out.done else 3


def cmd_status(args: argparse.Namespace) -> int:
    from edged.fleet.view import FleetView

    with FleetView(_address(args), args.prefix, args.group) as view:
        if not view.wait_connected(30):
            print(f"edged fleet status: cannot reach the broker at {args.broker}", file=sys.stderr)
            return 1
        view.wait_quiet(args.wait, max(10.0, args.wait * 5))
        states, rollout = view.snapshot(), view.rollout_status
    if args.json:
        print(json.dumps({"group": args.group, "devices": states, "rollout": rollout}, indent=2, sort_keys=True))
        return 0
    print(f"group {args.group}: {len(states)} devices")
    if rollout:
        print(
            f"rollout {rollout.get('model')} {rollout.get('version')}: {rollout.get('state')}: {rollout.get('reason')}"
        )
    now = time.time()
    for device, st in sorted(states.items()):
        age = now - float(st.get("ts") or now)
        for name, m in sorted((st.get("models") or {}).items()):
            reason = f"  {m.get('reason')}" if m.get("reason") else ""
            print(f"  {device:<20} {name:<16} {m.get('version') or '-':<10} {m.get('phase') or '-':<12}{reason}")
        if not st.get("models"):
            print(f"  {device:<20} (no fleet model)  reported {age:.0f} s ago")
    counts: dict[str, int] = {}
    for st in states.values():
        for m in (st.get("models") or {}).values():
            counts[m.get("phase") or "-"] = counts.get(m.get("phase") or "-", 0) + 1
    print("phases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) if counts else "phases: none")
    return 0
