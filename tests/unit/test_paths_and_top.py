"""Socket path resolution (edged.paths) and the frames of ``edged top`` (edged.tools.top.render), as
pure functions. The status documents are shaped like the daemon's /v2/edged/status; the real
daemon is exercised in tests/integration/test_cli_top.py."""

from __future__ import annotations

from typing import Any

import pytest

from edged.paths import DEFAULT_SOCKET, default_socket, resolve_socket
from edged.tools.top import Rates, render


def test_socket_order_flag_env_config_default(monkeypatch: pytest.MonkeyPatch) -> None:
    def config() -> tuple[str, str]:
        return "/cfg.sock", "[server] socket in /etc/edged/edged.toml"

    monkeypatch.setenv("EDGED_SOCKET", "/env.sock")
    got = resolve_socket("/flag.sock", config)
    assert (got.path, got.source) == ("/flag.sock", "--socket")
    got = resolve_socket(None, config)
    assert (got.path, got.source) == ("/env.sock", "$EDGED_SOCKET")
    monkeypatch.delenv("EDGED_SOCKET")
    got = resolve_socket(None, config)
    assert (got.path, got.source) == ("/cfg.sock", "[server] socket in /etc/edged/edged.toml")
    got = resolve_socket(None, lambda: None)
    assert (got.path, got.source) == (DEFAULT_SOCKET, "the default")
    assert default_socket() == DEFAULT_SOCKET
    monkeypatch.setenv("EDGED_SOCKET", "/env.sock")
    assert default_socket("/x.sock") == "/env.sock"
    monkeypatch.delenv("EDGED_SOCKET")
    assert default_socket("/x.sock") == "/x.sock"


def model(state: str = "ready", **kw: Any) -> dict[str, Any]:
    doc = {"state": state, "precision": "int8", "backend": "tensorrt", "queue": 0, "requests": 0}
    doc.update({"p50_ms": 0.412, "p99_ms": 1.5, "reason": ""})
    doc.update(kw)
    return doc


def status(models: dict[str, dict[str, Any]], builds: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "version": "0.1.0",
        "ready": True,
        "status": "2 models ready, 1 deferred: over budget",
        "uptime_s": 3725.0,
        "memory": {"source": "jtop", "budget_bytes": 6 << 30, "used_bytes": 1536 << 20},
        "builds": builds or [],
        "models": models,
    }


def test_a_frame_fits_80_columns_and_shows_every_field() -> None:
    st = status(
        {
            "detector": model(queue=3, p50_ms=4.25, p99_ms=9.75),
            "a-model-with-a-name-far-too-long-for-one-column": model("deferred", reason="over budget: needs 3 GiB"),
        },
        builds=[{"model": "ocr", "phase": "calibrating", "fraction": 0.45, "seconds": 75.2}],
    )
    lines = render(st, {"detector": 12.5}, width=80, height=24, clock="12:00:00")
    assert all(len(line) <= 80 for line in lines), [len(line) for line in lines]
    text = "\n".join(lines)
    assert "up 1h02m" in text and "12:00:00" in lines[0]
    assert "1.5 GiB of 6.0 GiB budget (25%)" in text
    row = next(line for line in lines if line.startswith("detector"))
    assert row.split() == ["detector", "ready", "int8", "3", "4.250", "9.750", "12.5", "tensorrt"]
    assert any(line.startswith("a-model-with-a-name-~") for line in lines)
    assert "  over budget: needs 3 GiB" in lines
    assert "builds in progress:" in lines
    assert any("ocr:" in line and "45%" in line and "calibrating" in line and "1m15s" in line for line in lines)


def test_many_models_are_cut_to_the_terminal_height() -> None:
    st = status({f"m{i:02d}": model() for i in range(40)})
    lines = render(st, {}, width=80, height=24)
    assert len(lines) == 24
    assert lines[-1].startswith("... ") and "more" in lines[-1]
    narrow = render(st, {}, width=50, height=100)
    assert all(len(line) <= 50 for line in narrow)


def test_rates_from_two_refreshes() -> None:
    rates = Rates()
    assert rates.update({"a": {"requests": 10}}, now=100.0) == {"a": None}
    assert rates.update({"a": {"requests": 30}, "b": {"requests": 5}}, now=102.0) == {"a": 10.0, "b": None}
    # a daemon restart resets the counts: no negative rate
    assert rates.update({"a": {"requests": 1}, "b": {"requests": 5}}, now=103.0) == {"a": None, "b": 0.0}
