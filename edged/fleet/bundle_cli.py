"""``edged bundle sign|verify|inspect``: signing a bundle, checking it as a device would, and
showing what it holds. Exit 0 on success, 1 when the bundle is refused, 2 for a usage fault."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from edged.fleet.bundle_base import BundleRefused


def add_bundle_command(sub: Any) -> None:
    """``edged bundle ...`` on the command's subparsers."""
    p = sub.add_parser("bundle", help="sign, verify and inspect model bundles")
    cmds = p.add_subparsers(dest="bundle_command", required=True)
    s = cmds.add_parser("sign", help="sign every file of a bundle folder (writes bundle.sig)")
    s.add_argument("dir", type=Path)
    s.add_argument("--key", type=Path, required=True, help="EC private key, PEM (P-256, P-384 or P-521)")
    s.add_argument("--certificate", type=Path, help="the key's signing certificate, PEM")
    s.add_argument("--chain", type=Path, action="append", default=[], help="issuer certificates up to the root")
    s.set_defaults(fn=cmd_sign)
    v = cmds.add_parser("verify", help="exit 0 only when every file verifies against a trusted key")
    v.add_argument("dir", type=Path, help="a bundle folder or tar archive")
    v.add_argument("--trust", type=Path, action="append", required=True, help="public key or CA certificate, PEM")
    v.set_defaults(fn=cmd_verify)
    i = cmds.add_parser("inspect", help="name, version, files, digests and the claimed signer")
    i.add_argument("dir", type=Path, help="a bundle folder or tar archive")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_inspect)


@contextlib.contextmanager
def _folder(path: Path) -> Iterator[tuple[Path, Path | None]]:
    """``path`` itself, or for an archive a temporary folder to extract it into."""
    if path.is_file():
        with tempfile.TemporaryDirectory(prefix="edged-bundle-") as tmp:
            yield path, Path(tmp) / "bundle"
    else:
        yield path, None


def _unchecked_on_purpose() -> None:
    """``sign`` and ``inspect`` open a bundle without trust on purpose (a signature there is
    replaced, or shown as claimed): the daemon's warning that it goes unchecked is noise here."""
    logging.getLogger("edged.fleet.bundle").setLevel(logging.ERROR)


def _refused(args: argparse.Namespace, err: BundleRefused) -> int:
    print(f"edged bundle {args.bundle_command}: refused ({err.code}): {err.reason}", file=sys.stderr)
    return 1


def cmd_sign(args: argparse.Namespace) -> int:
    from edged.fleet.bundle import open_bundle, sign_bundle

    for given in (args.key, args.certificate, *args.chain):
        if given is not None and not given.is_file():
            print(f"edged bundle sign: no such file {given}", file=sys.stderr)
            return 2
    if not args.dir.is_dir():
        print(f"edged bundle sign: {args.dir} is not a bundle folder", file=sys.stderr)
        return 2
    _unchecked_on_purpose()
    try:
        # The tables and files are checked first: a bundle no device would open is not signed.
        bundle = open_bundle(args.dir, [], require_signed=False)
        sign_bundle(args.dir, args.key, certificate=args.certificate, chain=args.chain)
    except BundleRefused as e:
        return _refused(args, e)
    except ValueError as e:  # an unreadable or unsupported key, a certificate that is not the key's
        print(f"edged bundle sign: {e}", file=sys.stderr)
        return 2
    print(f"signed {bundle.name} {bundle.version}: {len(bundle.files)} files ({args.dir / 'bundle.sig'})")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from edged.fleet.bundle import open_bundle

    with _folder(args.dir) as (path, extract_to):
        try:
            b = open_bundle(path, args.trust, require_signed=True, extract_to=extract_to)
        except BundleRefused as e:
            return _refused(args, e)
    print(f"verified {b.name} {b.version}: {len(b.files)} files, signed by {b.signer}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from edged.fleet.bundle import open_bundle
    from edged.fleet.signing import claimed_signer

    _unchecked_on_purpose()
    with _folder(args.dir) as (path, extract_to):
        try:
            b = open_bundle(path, [], require_signed=False, extract_to=extract_to)
            signer = claimed_signer(b.root)
        except BundleRefused as e:
            return _refused(args, e)
    info = {
        "name": b.name,
        "version": b.version,
        "created": b.created.isoformat(),
        "model": Path(b.model_config.path).relative_to(b.root).as_posix(),
        "signer": signer,
        "files": dict(b.files),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{b.name} {b.version}  created {info['created']}  model {info['model']}")
    print(f"signer: {signer + ' (claimed; check it with edged bundle verify)' if signer else 'none (unsigned)'}")
    for rel, digest in b.files.items():
        print(f"  {digest}  {rel}")
    return 0
