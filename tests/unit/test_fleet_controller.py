"""The controller's pure parts: stages, the failure share, and when a device has settled."""

from __future__ import annotations

import pytest

from edged.fleet import protocol
from edged.fleet.controller import parse_fraction, parse_stages, settled, stage_size
from edged.fleet.desired import Target

T = Target("/b/m.tar", "ab" * 32, "2.0.0")


def test_stages_and_failure_shares_parse_and_bad_ones_are_refused() -> None:
    assert parse_stages("1,10,100") == (1.0, 10.0, 100.0)
    for bad in ("10,1,100", "1,10", "0,100", "a,100", ""):
        with pytest.raises(ValueError):
            parse_stages(bad)
    assert parse_fraction("2%") == 0.02 and parse_fraction("0.5") == 0.5
    with pytest.raises(ValueError):
        parse_fraction("150%")


def test_a_stage_has_at_least_one_device_and_at_most_all() -> None:
    assert [stage_size(6, p) for p in (1, 10, 50, 100)] == [1, 1, 3, 6]
    assert [stage_size(200, p) for p in (1, 10, 100)] == [2, 20, 200]


def test_a_device_settles_when_it_serves_the_version_or_gives_it_up() -> None:
    def state(**m: object) -> dict[str, object]:
        return {"models": {"m": m}}

    assert settled(state(version="2.0.0", phase="serving"), "m", T) == "serving"
    assert settled(state(version="1.0.0", target="2.0.0", phase="rolled back"), "m", T) == "rolled back"
    assert settled(state(version="1.0.0", target="2.0.0", phase="building"), "m", T) is None
    assert settled(state(version="2.0.0", target="2.0.0", phase="watching"), "m", T) is None
    assert settled(state(version="1.0.0", target="1.5.0", phase="refused"), "m", T) is None  # another version
    assert settled(None, "m", T) is None


def test_state_topics_name_their_device_and_nothing_else() -> None:
    assert protocol.device_of_state("edged", "edged/cam-1/fleet/state") == "cam-1"
    assert protocol.device_of_state("edged", "edged/fleet/g/desired") is None
    assert protocol.device_of_state("a/b", "a/b/cam/fleet/state") == "cam"
    assert protocol.device_of_state("edged", "edged/$bad/fleet/state") is None


def test_a_prefix_or_device_that_could_reach_other_topics_is_refused() -> None:
    from edged.errors import ConfigError

    assert protocol.check_prefix("/plant/line1/edged/") == "plant/line1/edged"
    for bad in ("edged/+", "a//b", "$SYS", "ed#ged", ""):
        with pytest.raises(ConfigError):
            protocol.check_prefix(bad)
    assert protocol.check_device("cam-1") == "cam-1"
    for bad in ("fleet", "a/b", "+", "x" * 65):
        with pytest.raises(ConfigError):
            protocol.check_device(bad)


def test_the_rollout_command_says_what_it_refuses_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    from edged.cli import main

    assert main(["fleet", "rollout", "/nonexistent.tar", "--group", "g", "--stages", "1,x"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "edged fleet rollout: --stages: expected percentages" in err
