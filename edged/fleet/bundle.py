"""Model bundles: a folder (or a tar archive of one) holding a model's files, its edged table and
a signature over all of them, opened only once every check has passed.

    bundle/
      bundle.toml     format, name, version (PEP 440), created (a TOML datetime with its zone)
      model.toml      the keys of a [models.NAME] table; paths relative to the bundle
      model.onnx      or a .gguf; any other files: calibration samples, warm-up inputs
      bundle.sig      model-signing's signature over every other file (absent: unsigned)

``open_bundle`` walks, hashes and verifies the folder, then reads the two tables; it blocks
(hashing grows with the bundle), so the daemon calls it on a worker thread. What it returns was
checked against what is on disk at that moment: a bundle lives in a folder only edged writes.
"""

from __future__ import annotations

import datetime as dt
import logging
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec
from packaging.version import Version

from edged.config import ModelConfig
from edged.fleet.bundle_archive import extract_archive
from edged.fleet.bundle_base import (
    DEFAULT_LIMITS,
    METADATA,
    MODEL_TABLE,
    SIGNATURE,
    BundleLimits,
    BundleRefused,
)
from edged.fleet.bundle_files import digest_files, scan_tree
from edged.fleet.bundle_meta import BundleMeta, parse_version, read_meta, read_model
from edged.fleet.signing import sign_bundle, verify_signature
from edged.fleet.trust import load_trust

__all__ = [
    "Bundle",
    "BundleLimits",
    "BundleRefused",
    "make_bundle",
    "open_bundle",
    "parse_version",
    "sign_bundle",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bundle:
    root: Path
    name: str
    version: str
    created: dt.datetime
    model_config: ModelConfig  # paths resolved inside root
    files: Mapping[str, str] = field(repr=False)  # relative path -> sha256 hex; the signature's own file left out
    signer: str | None  # "sha256:<key fingerprint>", a certificate's subject, or None
    signed: bool  # the signature verified against fleet.trust

    @property
    def version_key(self) -> Version:
        """The version as packaging compares it: ``b.version_key > parse_version(running)``."""
        return parse_version(self.version)


def open_bundle(
    path: Path,
    trust: Sequence[Path],
    *,
    require_signed: bool,
    limits: BundleLimits = DEFAULT_LIMITS,
    extract_to: Path | None = None,
) -> Bundle:
    """Open the bundle at ``path`` (a folder, or a tar archive extracted into ``extract_to``,
    default the archive's name without its suffixes beside it), or raise BundleRefused."""
    path = Path(path)
    if path.is_file():
        path = extract_archive(path, extract_to or _beside(path), limits)
    root = _bundle_root(path)
    present = [rel for rel in scan_tree(root, limits) if rel != SIGNATURE]
    for needed in (METADATA, MODEL_TABLE):
        if needed not in present:
            raise BundleRefused(f"{root}: no {needed}; not a bundle", "not_a_bundle")
    signer, files = _verify(root, trust, require_signed, present)
    meta = read_meta(root)
    model = read_model(root, meta.name, set(files))
    bundle = Bundle(
        root=root,
        name=meta.name,
        version=meta.version,
        created=meta.created,
        model_config=model,
        files=MappingProxyType(dict(sorted(files.items()))),
        signer=signer,
        signed=signer is not None,
    )
    log.info(
        "opened bundle %s %s (%s)",
        bundle.name,
        bundle.version,
        f"signed by {signer}" if signer else "unsigned",
        extra={"model": bundle.name, "phase": "bundle"},
    )
    return bundle


def _verify(
    root: Path, trust_paths: Sequence[Path], require_signed: bool, present: list[str]
) -> tuple[str | None, dict[str, str]]:
    has_signature = (root / SIGNATURE).is_file()
    if not has_signature and require_signed:
        raise BundleRefused(f"{root}: no {SIGNATURE} and fleet.require_signed = true", "unsigned")
    trust = load_trust(list(trust_paths))
    if has_signature and trust.empty:
        if require_signed:
            raise BundleRefused(f"{SIGNATURE}: fleet.trust is empty, nothing to verify it with", "untrusted_signer")
        log.warning("bundle %s: signature not checked, fleet.trust is empty", root, extra={"phase": "bundle"})
    if not has_signature or trust.empty:
        return None, digest_files(root, present)
    verified = verify_signature(root, trust, present)
    return verified.signer, verified.files


def _bundle_root(path: Path) -> Path:
    """``path``, or the one folder inside it when an archive was made of the folder itself."""
    if path.is_dir() and not (path / METADATA).exists():
        inner = list(path.iterdir())
        if len(inner) == 1 and inner[0].is_dir() and not inner[0].is_symlink():
            return inner[0].resolve()
    return path.resolve()


def _beside(archive: Path) -> Path:
    name = archive.name
    for suffix in (".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".tar"):
        if name.endswith(suffix):
            return archive.with_name(name[: -len(suffix)])
    return archive.with_name(name + ".d")


def make_bundle(
    root: Path,
    *,
    name: str,
    version: str,
    model: Mapping[str, Any],
    files: Mapping[str, Path],
    created: dt.datetime | None = None,
) -> Path:
    """A new bundle folder: ``files`` (relative path in the bundle -> source file or folder)
    copied in, ``model`` (a [models.NAME] table, paths relative to the bundle) written as
    model.toml and the metadata as bundle.toml. Unsigned; ``sign_bundle`` signs it."""
    import tomli_w

    parse_version(version)
    root.mkdir(parents=True, exist_ok=False)
    for rel, src in files.items():
        dest = root / rel
        if dest.resolve().parent != root.resolve() and root.resolve() not in dest.resolve().parents:
            raise ValueError(f"{rel}: outside the bundle")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if Path(src).is_dir():
            shutil.copytree(src, dest, symlinks=False)
        else:
            shutil.copyfile(src, dest)
    when = (created or dt.datetime.now(dt.timezone.utc)).replace(microsecond=0)
    meta = BundleMeta(name=name, version=version, created=when)
    (root / METADATA).write_bytes(tomli_w.dumps(msgspec.to_builtins(meta, builtin_types=(dt.datetime,))).encode())
    (root / MODEL_TABLE).write_bytes(tomli_w.dumps(dict(model)).encode())
    return root
