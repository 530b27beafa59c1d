"""The device's fleet ledger: written atomically, read back, an unreadable one set aside."""

from __future__ import annotations

from pathlib import Path

import msgspec

from edged.fleet import ledger


def test_the_ledger_round_trips_and_an_unreadable_one_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "fleet" / "ledger.json"
    book = ledger.Ledger()
    rec = book.record("m")
    rec.current = ledger.Installed("2.0.0", "ab" * 32, str(tmp_path / "b"), {"path": "model.onnx"})
    rec.floor = "2.0.0"
    for i in range(ledger.MAX_BLOCKED + 3):
        rec.block(f"0.{i}+x", "refused")
    ledger.save(path, msgspec.json.encode(book))
    again = ledger.load(path)
    assert again == book and len(again.models["m"].blocked) == ledger.MAX_BLOCKED
    assert "0.0+x" not in again.models["m"].blocked  # the oldest go first
    path.write_bytes(b'{"models": {"m": {"floor": 3}}}')
    assert ledger.load(path) == ledger.Ledger()
    assert path.with_suffix(".unreadable").exists() and not path.exists()
    assert ledger.load(path) == ledger.Ledger()  # none yet: an empty ledger


def test_records_of_models_that_never_served_are_bounded() -> None:
    book = ledger.Ledger()
    served = book.record("served")
    served.current = ledger.Installed(version="1", sha256="0" * 64, bundle="/b", model={})
    for i in range(ledger.MAX_RECORDS + 50):
        book.record(f"m{i}").changed = float(i)
    assert len(book.models) == ledger.MAX_RECORDS
    assert "served" in book.models and f"m{ledger.MAX_RECORDS + 49}" in book.models and "m0" not in book.models
