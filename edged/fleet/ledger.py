"""What the device agent remembers across restarts, in ``{cache}/fleet/ledger.json``: per model,
the bundle version serving and the one before it (kept on disk until the next version serves),
the highest version that ever served (the anti-rollback floor), the desired versions blocked
after a refusal or a rollback, and the phase last reported.

Written atomically (temporary file, fsync, rename) from a worker thread; a ledger that does not
decode is set aside and the agent starts from the config file's models, never from a guess.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger(__name__)

MAX_BLOCKED = 16  # per model: the oldest blocked keys are forgotten first
# Records in all: a desired state names at most max_models, but successive messages may name
# new models each time; the records of models that never served are forgotten first, oldest first.
MAX_RECORDS = 256


class Installed(msgspec.Struct):
    """A bundle version that served on this device: where it lies and the model table it gave."""

    version: str
    sha256: str
    bundle: str  # the unpacked bundle's folder
    model: dict[str, Any]  # edged.config.ModelConfig as builtins, paths inside the bundle
    signer: str = ""


class ModelRecord(msgspec.Struct):
    current: Installed | None = None
    previous: Installed | None = None
    floor: str = ""  # the highest version that served: an older one is refused
    blocked: dict[str, str] = msgspec.field(default_factory=dict)  # desired key -> why
    phase: str = ""
    reason: str = ""
    target: str = ""  # the desired version being worked on or last settled
    target_key: str = ""
    gate: dict[str, Any] | None = None
    build_s: float | None = None
    changed: float = 0.0  # wall-clock time of the last phase change

    def block(self, key: str, why: str) -> None:
        self.blocked[key] = why
        while len(self.blocked) > MAX_BLOCKED:
            del self.blocked[next(iter(self.blocked))]


class Ledger(msgspec.Struct):
    models: dict[str, ModelRecord] = msgspec.field(default_factory=dict)

    def record(self, name: str) -> ModelRecord:
        if name not in self.models and len(self.models) >= MAX_RECORDS:
            idle = [(r.changed, n) for n, r in self.models.items() if r.current is None]
            if idle:
                del self.models[min(idle)[1]]
        return self.models.setdefault(name, ModelRecord())


def load(path: Path) -> Ledger:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Ledger()
    try:
        return msgspec.json.decode(data, type=Ledger)
    except msgspec.MsgspecError as e:
        aside = path.with_suffix(".unreadable")
        os.replace(path, aside)
        log.error("fleet ledger %s does not decode (%s); set aside as %s", path, e, aside.name)
        return Ledger()


def save(path: Path, data: bytes) -> None:
    """Write the encoded ledger; blocking (fsync): call it in a worker thread."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
