"""edged.ratelog: a flood of one kind of line is one line per interval, with the count left out."""

from __future__ import annotations

import logging

import pytest

from edged.ratelog import RateLimitedLog


def test_one_line_per_kind_per_interval_with_the_count_left_out(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("edged.test.ratelog"), every_s=3600)
    with caplog.at_level(logging.INFO, logger="edged.test.ratelog"):
        for i in range(1000):
            log.note(logging.INFO, "dropped", "request %d dropped", i)
        log.note(logging.WARNING, "retained", "retained request on %s ignored", "t")
    assert [r.getMessage() for r in caplog.records] == ["request 0 dropped", "retained request on t ignored"]
    log.every_s = 0  # the interval has passed: the next line says how many were left out
    with caplog.at_level(logging.INFO, logger="edged.test.ratelog"):
        log.note(logging.INFO, "dropped", "request %d dropped", 1000)
    assert caplog.records[-1].getMessage() == "request 1000 dropped (and 999 more like it)"
