"""The states a model moves through, in one place.

The values are wire format: the status API (``/v2/edged/status``, upper-cased in the repository
index), the retained MQTT state topics and telemetry, the log's ``phase`` field and ``edged top``
all show them as they are, so a rename here is a protocol change. ``ModelState`` is a ``str``
enum (Python 3.10 has no ``StrEnum``) whose ``str()`` and ``format()`` give the value, and orjson
writes the value; comparing with a plain string from JSON works either way.

Standard library only: the transports, the registry and the command line all import it.
"""

from __future__ import annotations

from enum import Enum


class ModelState(str, Enum):
    PENDING = "pending"  # configured, not resolved yet
    BUILDING = "building"  # its engine builds (in the child process)
    BUILT = "built"  # its engine was built at boot and waits for its turn to load
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"  # loaded and warm: requests run
    LAZY = "lazy"  # built, not loaded: the first request loads it
    DEFERRED = "deferred"  # over the memory budget: not loaded until a reload or a restart
    # Its backend's library is not installed yet (llama-cpp-python compiles for minutes): checked
    # again every few seconds, it loads without a restart once it imports; the reason says which
    # library and, once it imports, which step of the load is under way.
    WAITING = "waiting"
    UNLOADED = "unloaded"  # unloaded by an operator (or at stop): 503 until loaded again
    FAILED = "failed"  # resolving, building or loading failed; the reason says why

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:  # f"{state:<8}" pads the value on every Python
        return format(self.value, spec)

    @classmethod
    def named(cls, text: object) -> ModelState | None:
        """The state a status document names (a plain string); None for one this version does
        not know, from a newer daemon."""
        try:
            return cls(text)
        except ValueError:
            return None

    @property
    def serving(self) -> bool:
        """It answers requests: it is loaded, or it loads on the first one. A device takes a
        share of a model's fleet requests only in these states."""
        return self in _SERVING

    @property
    def out_of_service(self) -> bool:
        """It will not answer until something changes (a reload, memory freed, an operator's
        load): a device gives its share of the fleet's requests back."""
        return self in _OUT_OF_SERVICE

    @property
    def loads_on_demand(self) -> bool:
        """Built but not loaded, and a request loads it (given its engine is in the cache). Only a
        lazy model: one an operator unloaded stays unloaded (503) until loaded again."""
        return self in _ON_DEMAND

    @property
    def settled(self) -> bool:
        """It stays in this state until something outside the model changes it; the others are
        steps of a build or a load. Readiness waits until every boot model has settled. A model
        waiting for its backend's library has settled: the library may take minutes to install,
        or never come, and must not keep the models that can serve from being ready."""
        return self not in _TRANSITIONS


_SERVING = frozenset({ModelState.READY, ModelState.LAZY})
_OUT_OF_SERVICE = frozenset({ModelState.FAILED, ModelState.DEFERRED, ModelState.UNLOADED, ModelState.WAITING})
_ON_DEMAND = frozenset({ModelState.LAZY})
_TRANSITIONS = frozenset(
    {ModelState.PENDING, ModelState.BUILDING, ModelState.BUILT, ModelState.LOADING, ModelState.WARMING}
)

# The request path compares a model's state with READY once per request. Before Python 3.12 a
# member looked up through its class goes through EnumMeta.__getattr__: `state == ModelState.READY`
# cost about 150 ns more than `state is READY` with this module-level name (Python 3.11 here), so
# the request path uses this name for the same member.
READY = ModelState.READY
