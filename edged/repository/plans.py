"""A TensorRT plan built elsewhere, and whether this device may serve it as it is.

An engine loads only on the TensorRT that built it and is tuned for one GPU (design section 5):
edged serves a plan it did not build only when the manifest beside it (``model.plan.json``, the
manifest edged writes beside each engine in its cache) says it was built by this TensorRT for
this device, with the same fingerprint edged's own cache keys hold, and names this very file by
its checksum. A plan without such a manifest cannot show what it is bound to, and TensorRT's own
check when it deserialises one covers its version and compute capability, not the GPU's size,
driver or L4T release: such a plan is not served as it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from edged.backends.base import Backend
from edged.cache.store import Entry, file_digest
from edged.errors import EdgedError

ENGINE_SUFFIXES = (".plan", ".engine")
_MANIFEST_MAX = 1 << 20

# This device's TensorRT: (its version, its fingerprint); raises EdgedError saying why there is none.
Identity = Callable[[], tuple[str, Mapping[str, str]]]


def manifest_path(plan: Path) -> Path:
    return plan.with_name(plan.name + ".json")


def read_manifest(plan: Path) -> dict[str, Any] | None:
    path = manifest_path(plan)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(_MANIFEST_MAX))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # present but unreadable: no fingerprint to match
    return data if isinstance(data, dict) else {}


def tensorrt_identity() -> tuple[str, Mapping[str, str]]:
    """This device's TensorRT version and fingerprint, as edged's engine cache keys hold them."""
    from edged import backends

    cls = backends.backend_class("tensorrt")
    ok, why = cls.available()
    if not ok:
        raise EdgedError(why)
    return cls.version(), cls.fingerprint()


def built_by(manifest: Mapping[str, Any]) -> str:
    """What the manifest says built the plan, for messages."""
    fields = manifest.get("key_fields") or {}
    device = fields.get("device") or {}
    where = device.get("board") or device.get("gpu") or "an unnamed device"
    return f"{fields.get('backend', '?')} {fields.get('backend_version', '?')} on {where}"


def differences(manifest: Mapping[str, Any], version: str, fingerprint: Mapping[str, str]) -> list[str]:
    """How the manifest's engine differs from what this device builds: [] when it does not."""
    fields = manifest.get("key_fields") or {}
    out = []
    if fields.get("backend") != "tensorrt":
        out.append(f"backend {fields.get('backend')!r} (this device: 'tensorrt')")
    if fields.get("backend_version") != version:
        out.append(f"TensorRT {fields.get('backend_version')!r} (this device: {version!r})")
    device = fields.get("device")
    theirs: dict[str, Any] = device if isinstance(device, dict) else {}
    for key in sorted(set(theirs) | set(fingerprint)):
        if theirs.get(key) != fingerprint.get(key):
            out.append(f"{key} {theirs.get(key)!r} (this device: {fingerprint.get(key)!r})")
    return out


def verdict(plan: Path, identity: Identity = tensorrt_identity, digest: Callable[[str], str] = file_digest) -> str:
    """'' when ``plan`` may be served here as it is; otherwise why not."""
    manifest = read_manifest(plan)
    mpath = manifest_path(plan)
    if manifest is None:
        return f"{plan.name} has no manifest ({mpath.name}) to say which TensorRT, CUDA and GPU built it"
    if not manifest.get("key_fields"):
        return f"{mpath.name} is not an edged engine manifest (it has no key_fields)"
    try:
        version, fingerprint = identity()
    except EdgedError as e:
        return f"{plan.name} was built by {built_by(manifest)}, and this machine has no usable TensorRT ({e.message})"
    diff = differences(manifest, version, fingerprint)
    if diff:
        return f"{plan.name} was built for another device: {'; '.join(diff)}"
    try:
        actual = digest(str(plan))
    except OSError as e:
        return f"{plan.name} cannot be read: {e.strerror}"
    if actual != manifest.get("artifact_sha256"):
        return f"{plan.name} is not the file {mpath.name} describes (its checksum differs)"
    return ""


def is_engine(path: str, cls: type[Backend]) -> bool:
    """Whether a model's file is an engine to serve as it is rather than a model to build from."""
    return cls.name == "tensorrt" and path.lower().endswith(ENGINE_SUFFIXES)


def prebuilt_entry(path: str, cls: type[Backend], digest: Callable[[str], str]) -> Entry:
    """The plan at ``path`` as an entry to load (its key is '': not one of the cache's own, never
    moved aside or rewritten); EdgedError when its manifest does not match this device."""
    plan = Path(path)
    why = verdict(plan, lambda: (cls.version(), cls.fingerprint()), digest)
    if why:
        raise EdgedError(
            f"{why}; edged serves a plan built elsewhere only when its manifest matches this device: "
            f"put the ONNX model beside it (model.onnx) and edged builds the engine here"
        )
    return Entry("", plan, manifest_path(plan), read_manifest(plan) or {})
