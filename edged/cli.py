"""The ``edged`` command: argument parsing and one function per subcommand, no business logic."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from edged import __version__
from edged.config import Config, default_config_path, format_size, load
from edged.errors import ConfigError, EdgedError


def _config(args: argparse.Namespace) -> Config:
    return load(args.config or default_config_path())


def _socket(args: argparse.Namespace) -> str:
    """--socket, then EDGED_SOCKET, then the config's socket, then the default."""
    if args.socket:
        return str(args.socket)
    if os.environ.get("EDGED_SOCKET"):
        return os.environ["EDGED_SOCKET"]
    path = args.config or default_config_path()
    if os.path.exists(path):
        try:
            return load(path).server.socket
        except EdgedError:
            pass
    from edged.config import DEFAULT_SOCKET

    return DEFAULT_SOCKET


EX_CONFIG = 78  # sysexits.h; the unit's RestartPreventExitStatus= stops a restart loop on it


def cmd_serve(args: argparse.Namespace) -> int:
    from edged import early_signals

    early_signals.hold()  # SIGHUP/SIGTERM/SIGINT are remembered from here until the loop runs
    import faulthandler

    from edged.daemon import serve

    # A watchdog abort (SIGABRT) then prints every thread's stack to the journal.
    faulthandler.enable()
    try:
        cfg = _config(args)
    except ConfigError as e:
        print(f"edged serve: {e.message}", file=sys.stderr)
        return EX_CONFIG
    return serve(cfg)


def cmd_plan(args: argparse.Namespace) -> int:
    from edged.planning import offline_plan

    report = offline_plan(_config(args))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    mem = report["memory"]
    print(
        f"memory: {mem['source']}, {format_size(mem['total_bytes'])} total, "
        f"{format_size(mem['available_bytes'])} available, budget {format_size(mem['budget_bytes'])}"
    )
    rows = [
        (
            m["name"],
            m["decision"],
            m["backend"],
            m["precision"],
            m["priority"],
            format_size(m["footprint_bytes"]) + ("" if m["measured"] else " (est.)"),
            "cached" if m["cached"] else "needs build",
            m["reason"],
        )
        for m in report["models"]
    ]
    _table(("model", "plan", "backend", "precision", "prio", "footprint", "engine", "reason"), rows)
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from edged.planning import build_all

    return asyncio.run(build_all(_config(args), check=args.check, out=sys.stdout))


def cmd_status(args: argparse.Namespace) -> int:
    from edged.client import Client

    with Client(_socket(args)) as c:
        st = c.status()
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"edged {st['version']}: {'ready' if st['ready'] else 'not ready'} - {st['status']}")
    mem = st["memory"]
    print(f"memory ({mem['source']}): budget {format_size(mem['budget_bytes'])}, used {format_size(mem['used_bytes'])}")
    _models_table(st)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from edged.client import Client

    with Client(_socket(args)) as c:
        _models_table(c.status())
    return 0


def _models_table(st: dict[str, Any]) -> None:
    rows = [
        (
            n,
            m["state"],
            m["backend"] or "-",
            m["precision"] or "-",
            m["requests"],
            "-" if m["p50_ms"] is None else f"{m['p50_ms']:.3f}",
            m["reason"],
        )
        for n, m in st["models"].items()
    ]
    _table(("model", "state", "backend", "precision", "requests", "p50 ms", "reason"), rows)


def cmd_infer(args: argparse.Namespace) -> int:
    import numpy as np

    from edged.client import Client

    inputs = {}
    for item in args.input:
        name, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"edged infer: --input takes NAME=FILE.npy, got {item!r}")
        inputs[name] = np.load(path, allow_pickle=False)
    with Client(_socket(args)) as c:
        outputs = c.infer(args.model, inputs) if not args.shm else c.infer_shm(args.model, inputs)
    if args.output:
        savez: Any = np.savez  # numpy's stub types the keyword arrays as its own flags
        savez(args.output, **outputs)
        print(f"saved {', '.join(outputs)} to {args.output}")
    else:
        for name, arr in outputs.items():
            print(f"{name}: {arr.dtype}{list(arr.shape)}")
            print(np.array2string(arr, threshold=20, edgeitems=3))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from edged.client import Client

    try:
        with Client(_socket(args), timeout=args.timeout) as c:
            ok = c.ready() if args.ready else c.live()
    except OSError as e:
        print(f"edged is not reachable: {e}", file=sys.stderr)
        return 1
    print(("ready" if args.ready else "live") if ok else "not ready")
    return 0 if ok else 1


def cmd_selftest(args: argparse.Namespace) -> int:
    from edged.selftest import run_selftest

    return int(run_selftest(args.config, sys.stdout))


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edged", description="On-device inference daemon")
    p.add_argument("--version", action="version", version=f"edged {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def add(
        name: str, fn: Callable[[argparse.Namespace], int], help_: str, client: bool = False
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        sp.set_defaults(fn=fn)
        sp.add_argument(
            "--config", type=Path, default=None, help="config file (default: $EDGED_CONFIG, then /etc/edged/edged.toml)"
        )
        if client:
            sp.add_argument(
                "--socket", default=None, help="socket (default: $EDGED_SOCKET, the config's, /run/edged/edged.sock)"
            )
        return sp

    add("serve", cmd_serve, "run the daemon")
    add("plan", cmd_plan, "print the memory plan without loading anything").add_argument("--json", action="store_true")
    b = add("build", cmd_build, "prebuild every model's engine (provisioning)")
    b.add_argument("--check", action="store_true", help="build nothing; exit 1 if a build is needed")
    add("status", cmd_status, "daemon, memory and model status", client=True).add_argument(
        "--json", action="store_true"
    )
    add("models", cmd_models, "list models and their states", client=True)
    i = add("infer", cmd_infer, "run one inference from .npy files", client=True)
    i.add_argument("model")
    i.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", required=True)
    i.add_argument("--output", help="save outputs to this .npz instead of printing them")
    i.add_argument("--shm", action="store_true", help="send inputs through shared memory")
    h = add("health", cmd_health, "exit 0 when live (or ready with --ready)", client=True)
    h.add_argument("--ready", action="store_true")
    h.add_argument("--timeout", type=float, default=5.0)
    add("selftest", cmd_selftest, "Jetson acceptance test: versions, INT8 build, gate, cold start")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code = args.fn(args)
        return int(code)
    except EdgedError as e:
        print(f"edged {args.command}: {e.message}", file=sys.stderr)
        return 2
    except (ConnectionRefusedError, FileNotFoundError) as e:
        print(f"edged {args.command}: cannot reach the daemon: {e}", file=sys.stderr)
        return 1
