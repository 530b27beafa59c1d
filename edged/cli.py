"""The ``edged`` command: argument parsing and one function per subcommand, no business logic."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import stat
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edged import __version__
from edged.config import Config, default_config_path, format_size, load
from edged.errors import ConfigError, EdgedError
from edged.fleet import commands as fleet_commands
from edged.fleet.bundle_cli import add_bundle_command
from edged.paths import DEFAULT_SOCKET, SocketPath, resolve_socket
from edged.tools.table import print_table

if TYPE_CHECKING:
    from edged.client import Client


def _config(args: argparse.Namespace) -> Config:
    from edged.repository.load import load_config  # protobuf and onnx, for a model repository only

    return load_config(args.config or default_config_path(), getattr(args, "model_repository", None) or "")


def _socket(args: argparse.Namespace) -> SocketPath:
    """--socket, then $EDGED_SOCKET, then the config's [server] socket, then the default; the
    answer says which, so an error can name the knob."""
    cfg_path = str(args.config or default_config_path())
    why: list[str] = []

    def from_config() -> tuple[str, str] | None:
        if not os.path.exists(cfg_path):
            why.append(f"{cfg_path} does not exist")
            return None
        try:
            sock = load(cfg_path).server.socket
        except EdgedError as e:
            why.append(f"{cfg_path} cannot be read: {e.message}")
            return None
        if sock == DEFAULT_SOCKET:
            why.append(f"{cfg_path} sets no other")
            return None
        return sock, f"[server] socket in {cfg_path}"

    found = resolve_socket(args.socket, from_config)
    if why and found.path == DEFAULT_SOCKET and found.source == "the default":
        return SocketPath(found.path, f"the default, as {why[0]}")
    return found


class Unreachable(Exception):
    """The daemon's socket cannot be connected to; the message names the path and its source."""

    def __init__(self, sock: SocketPath, err: OSError) -> None:
        why = _why(err)
        if isinstance(err, ConnectionRefusedError) and os.path.exists(sock.path) and not _is_socket(sock.path):
            why = "that path is not a socket"
        super().__init__(f"cannot reach the daemon at {sock.path} ({_origin(sock)}): {why}")


def _is_socket(path: str) -> bool:
    return stat.S_ISSOCK(os.stat(path).st_mode)


class UsageError(Exception):
    """A fault in the command line itself (an input file that is missing or unreadable)."""


def _origin(sock: SocketPath) -> str:
    if sock.source.startswith("the default"):
        return f"{sock.source}; choose another with --socket, $EDGED_SOCKET or [server] socket in the config"
    return f"from {sock.source}"


def _why(err: OSError) -> str:
    if isinstance(err, FileNotFoundError):
        return "no such socket - is edged running? (systemctl status edged)"
    if isinstance(err, ConnectionRefusedError):
        return "connection refused - the socket exists but nothing listens on it; is edged running?"
    if isinstance(err, PermissionError):
        return "permission denied - join the socket's group ([server] socket_group) or use sudo"
    if isinstance(err, TimeoutError):
        return "no answer in time"
    return err.strerror or str(err)


def _client(args: argparse.Namespace, timeout: float = 30.0) -> Client:
    """A client for the resolved socket, after one connect to check it: a daemon that cannot be
    reached is reported with the path tried and where it came from."""
    from edged.client import Client

    sock = _socket(args)
    args.resolved_socket = sock
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(sock.path)
    except OSError as e:
        raise Unreachable(sock, e) from None
    finally:
        probe.close()
    return Client(sock.path, timeout=timeout)


EX_CONFIG = 78  # sysexits.h; the unit's RestartPreventExitStatus= stops a restart loop on it


def cmd_serve(args: argparse.Namespace) -> int:
    from edged.lifecycle import early_signals

    early_signals.hold()  # SIGHUP/SIGTERM/SIGINT are remembered from here until the loop runs
    import faulthandler

    from edged.lifecycle.daemon import serve

    # A watchdog abort (SIGABRT) then prints every thread's stack to the journal.
    faulthandler.enable()
    try:
        cfg = _config(args)
    except ConfigError as e:
        print(f"edged serve: {e.message}", file=sys.stderr)
        return EX_CONFIG
    return serve(cfg)


def cmd_plan(args: argparse.Namespace) -> int:
    from edged.tools.plan import offline_plan

    report = offline_plan(_config(args))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    mem = report["memory"]
    print(
        f"memory: {mem['source']}, {format_size(mem['total_bytes'])} total, "
        f"{format_size(mem['available_bytes'])} available, budget {format_size(mem['budget_bytes'])}"
    )
    from edged.quantize.figures import precision_text

    rows = [
        (
            m["name"],
            m["decision"],
            m["backend"],
            precision_text(m["precision"], m.get("gate")),
            m["priority"],
            format_size(m["footprint_bytes"]) + ("" if m["measured"] else " (est.)"),
            "cached" if m["cached"] else "needs build",
            m["reason"],
        )
        for m in report["models"]
    ]
    print_table(("model", "plan", "backend", "precision", "prio", "footprint", "engine", "reason"), rows)
    _auto_lines(report["models"])
    return 0


def _auto_lines(models: list[dict[str, Any]]) -> None:
    """precision = "auto": each candidate's median and gate, and the choice, under the table."""
    from edged.quantize.figures import auto_text

    for m in models:
        if m.get("auto"):
            print(f"{m['name']}: auto: {auto_text(m['auto'])}")


def cmd_build(args: argparse.Namespace) -> int:
    from edged.tools.plan import build_all

    return asyncio.run(build_all(_config(args), check=args.check, out=sys.stdout))


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
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
    with _client(args) as c:
        st = c.status()
    _models_table(st)
    return 0


def _models_table(st: dict[str, Any]) -> None:
    from edged.quantize.figures import precision_text

    rows = [
        (
            n,
            m["state"],
            m["backend"] or "-",
            precision_text(m["precision"], m.get("gate")),
            m["requests"],
            "-" if m["p50_ms"] is None else f"{m['p50_ms']:.3f}",
            m["reason"],
        )
        for n, m in st["models"].items()
    ]
    print_table(("model", "state", "backend", "precision", "requests", "p50 ms", "reason"), rows)
    _auto_lines([dict(m, name=n) for n, m in st["models"].items()])
    for n, m in st["models"].items():
        origin = m.get("repository") or {}
        if origin.get("note"):  # what a repository model serves otherwise than its config.pbtxt asks
            print(f"{n} (version {origin['version']} of {origin['model']}): {origin['note']}")
        fit = m.get("batching") or {}
        if fit.get("reason") and fit["reason"] != "max_batch is 1":  # a model configured to batch
            what = f"batches of at most {fit['rows']} rows" if fit["on"] else "unbatched"
            print(f"{n}: {what}: {fit['reason']}")


def cmd_infer(args: argparse.Namespace) -> int:
    import numpy as np

    inputs = {}
    for item in args.input:
        name, _, path = item.partition("=")
        if not path:
            raise UsageError(f"--input takes NAME=FILE.npy, got {item!r}")
        inputs[name] = _load_input(name, path)
    with _client(args) as c:
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


def _load_input(name: str, path: str) -> Any:
    import numpy as np

    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise UsageError(f"input '{name}': no such file {path}") from None
    except OSError as e:  # a folder, no permission
        raise UsageError(f"input '{name}': cannot read {path}: {e.strerror or e}") from None
    except ValueError:  # numpy reads anything that is not .npy as a pickle, which edged never loads
        raise UsageError(f"input '{name}': {path} is not a .npy file of numbers (np.save writes one)") from None


def cmd_health(args: argparse.Namespace) -> int:
    try:
        with _client(args, timeout=args.timeout) as c:
            ok = c.ready() if args.ready else c.live()
    except Unreachable as e:
        print(f"edged health: {e}", file=sys.stderr)
        return 1
    print(("ready" if args.ready else "live") if ok else "not ready")
    return 0 if ok else 1


def cmd_top(args: argparse.Namespace) -> int:
    from edged.tools.top import run_top

    with _client(args, timeout=max(args.interval * 2, 5.0)) as c:
        return run_top(c, interval=args.interval, once=args.once, out=sys.stdout)


def cmd_selftest(args: argparse.Namespace) -> int:
    from edged.tools.selftest import run_selftest

    return int(run_selftest(args.config, sys.stdout))


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
                "--socket",
                default=None,
                help=f"socket (default: $EDGED_SOCKET, then [server] socket in the config, then {DEFAULT_SOCKET})",
            )
        return sp

    repository_help = "a Triton model repository to serve, in place of [server] model_repository"
    add("serve", cmd_serve, "run the daemon").add_argument("--model-repository", metavar="PATH", help=repository_help)
    pl = add("plan", cmd_plan, "print the memory plan without loading anything")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--model-repository", metavar="PATH", help=repository_help)
    b = add("build", cmd_build, "prebuild every model's engine (provisioning)")
    b.add_argument("--check", action="store_true", help="build nothing; exit 1 if a build is needed")
    b.add_argument("--model-repository", metavar="PATH", help=repository_help)
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
    t = add("top", cmd_top, "live view of models, memory and builds (q to quit)", client=True)
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    t.add_argument("--once", action="store_true", help="print one frame without colours or redraws, then exit")
    add("selftest", cmd_selftest, "Jetson acceptance test: versions, INT8 build, gate, cold start")
    fleet_commands.add_parsers(sub)
    add_bundle_command(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code = args.fn(args)
        return int(code)
    except EdgedError as e:
        print(f"edged {args.command}: {e.message}", file=sys.stderr)
        return 2
    except UsageError as e:
        print(f"edged {args.command}: {e}", file=sys.stderr)
        return 2
    except Unreachable as e:
        print(f"edged {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130  # Ctrl-C: the shell's convention, without a traceback
    except (ConnectionError, TimeoutError) as e:
        # Connected once, then the exchange failed: the daemon stopped or is wedged.
        sock = getattr(args, "resolved_socket", None)
        where = f" at {sock.path} ({_origin(sock)})" if sock is not None else ""
        print(f"edged {args.command}: lost the daemon{where}: {_why(e)}", file=sys.stderr)
        return 1
