"""The fleet's topics and the names every party uses (the device agent, the controller, the
simulated devices of the benchmark); docs/fleet-rollout.md is the reference.

    {prefix}/fleet/{group}/desired          retained, the controller: what the group serves
    {prefix}/{device}/fleet/desired         retained, the controller: what overrides it on one device
    {prefix}/{device}/fleet/state           retained, the device: version and phase per model
    {prefix}/{device}/fleet/events          QoS 1, the device: a bundle refused (edged/fleet/refusals.py)
    {prefix}/fleet/{group}/heartbeat/{device}  QoS 0, the device: versions, health, memory, latency
    {prefix}/fleet/{group}/rollout          retained, the controller: the rollout's progress or pause

Every topic a device or the controller builds from a name goes through ``topic_part`` first: a
name that holds a wildcard, a separator or a NUL could subscribe to, or publish on, topics that
are not its own.
"""

from __future__ import annotations

import re

from edged.errors import ConfigError

# Model and device names that are safe both as a topic level and as a file name.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

PHASES = ("downloading", "verifying", "building", "gating", "watching", "serving", "failed", "rolled back", "refused")
# Phases that end a version's attempt; the controller counts a device as done in one of these.
SETTLED = ("serving", "failed", "rolled back", "refused")
FAILED = ("failed", "rolled back", "refused")


def topic_part(value: str, what: str) -> str:
    """``value`` when it is a safe topic level, else ConfigError naming ``what``."""
    if not NAME_RE.match(value):
        raise ConfigError(f"{what}: {value!r} cannot name a topic level (letters, digits, '_', '.', '-'; at most 64)")
    return value


def check_prefix(prefix: str) -> str:
    """``mqtt.topic_prefix`` without its outer slashes, or ConfigError: every level must be a
    plain name (no wildcard, no NUL, no leading ``$``, not empty)."""
    value = prefix.strip("/")
    for level in value.split("/"):
        if not level or any(c in level for c in "+#\0") or level.startswith("$"):
            raise ConfigError(f"mqtt.topic_prefix: {prefix!r} cannot begin a topic")
    return value


def check_device(device: str) -> str:
    """A device id: a safe topic level, and not ``fleet`` (whose topics are the group's)."""
    topic_part(device, "mqtt.device_id")
    if device == "fleet":
        raise ConfigError("mqtt.device_id: 'fleet' names the group topics, not a device")
    return device


def group_desired(prefix: str, group: str) -> str:
    return f"{prefix}/fleet/{group}/desired"


def device_desired(prefix: str, device: str) -> str:
    return f"{prefix}/{device}/fleet/desired"


def device_state(prefix: str, device: str) -> str:
    return f"{prefix}/{device}/fleet/state"


def device_events(prefix: str, device: str) -> str:
    return f"{prefix}/{device}/fleet/events"


def heartbeat(prefix: str, group: str, device: str) -> str:
    return f"{prefix}/fleet/{group}/heartbeat/{device}"


def rollout(prefix: str, group: str) -> str:
    return f"{prefix}/fleet/{group}/rollout"


def all_states(prefix: str) -> str:
    """What the controller subscribes to: every device's state (filtered by group on receipt)."""
    return f"{prefix}/+/fleet/state"


def device_of_state(prefix: str, topic: str) -> str | None:
    """The device a state topic belongs to, None for any other topic."""
    parts = topic.split("/")
    head = prefix.split("/")
    if len(parts) != len(head) + 3 or parts[: len(head)] != head or parts[len(head) + 1 :] != ["fleet", "state"]:
        return None
    device = parts[len(head)]
    return device if NAME_RE.match(device) else None
