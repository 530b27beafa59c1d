"""Model states (edged/serving/states.py): the wire values, how they print and serialise, and which
states serve, give fleet requests back, load on demand or have settled."""

from __future__ import annotations

import json

import orjson

from edged.serving.states import READY, ModelState

# The status API, the MQTT state topics, the logs and `edged top` show these; clients match them.
WIRE = [
    "pending",
    "building",
    "built",
    "loading",
    "warming",
    "ready",
    "lazy",
    "deferred",
    "waiting",
    "unloaded",
    "failed",
]


def test_the_wire_values_are_the_documented_strings() -> None:
    assert [s.value for s in ModelState] == WIRE
    assert READY is ModelState.READY


def test_a_state_prints_and_serialises_as_its_value() -> None:
    s = ModelState.WARMING
    assert (str(s), f"{s}", f"{s:>8}") == ("warming", "warming", " warming")
    assert "%s" % s == "warming"  # noqa: UP031 -- how logging formats it
    assert orjson.dumps({"state": s}) == b'{"state":"warming"}'
    assert json.dumps({"state": s}) == '{"state": "warming"}'
    assert s == "warming" and "warming" in {s} and s.upper() == "WARMING"  # a plain string from JSON compares equal


def test_a_name_from_a_status_document() -> None:
    assert ModelState.named("lazy") is ModelState.LAZY
    assert ModelState.named("hibernating") is None  # a state a newer daemon may add
    assert ModelState.named(None) is None


def test_which_states_serve_and_which_have_settled() -> None:
    serving = {s.value for s in ModelState if s.serving}
    out = {s.value for s in ModelState if s.out_of_service}
    on_demand = {s.value for s in ModelState if s.loads_on_demand}
    settled = {s.value for s in ModelState if s.settled}
    assert serving == {"ready", "lazy"}
    # An unloaded model answers 503 until loaded; a waiting one until its backend's library imports.
    assert out == {"failed", "deferred", "unloaded", "waiting"}
    assert on_demand == {"lazy"}
    # Waiting has settled: a library that takes minutes to install must not hold readiness back.
    assert settled == {"ready", "lazy", "deferred", "waiting", "unloaded", "failed"}
    assert not serving & out and serving | out <= settled
