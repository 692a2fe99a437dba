"""Repeated log lines (utils/logging.RepeatLimiter): one per logger, template and key per period, the
next one counting those held back."""

from __future__ import annotations

import logging

import pytest

from swarmtrain.utils.logging import RepeatLimiter

pytestmark = pytest.mark.unit


class Lines(logging.Handler):
    """The messages logged, on the test's own logger (the `swarmtrain` logger may not propagate)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def limited():
    now = [0.0]
    limiter = RepeatLimiter(period_s=10.0, clock=lambda: now[0])
    logger = logging.getLogger("swarmtrain.test_log_repeats")
    logger.setLevel(logging.INFO)
    lines = Lines()
    logger.addHandler(lines)
    yield limiter, logger, now, lines
    logger.removeHandler(lines)


def test_a_repeated_line_passes_once_per_period_then_says_how_many_were_held(limited):
    limiter, logger, now, lines = limited
    assert limiter.log(logger, logging.INFO, "stage %d retry %d", 0, 1)
    for attempt in range(2, 6):
        now[0] += 1.0
        assert not limiter.log(logger, logging.INFO, "stage %d retry %d", 0, attempt)
    now[0] = 12.0
    assert limiter.log(logger, logging.INFO, "stage %d retry %d", 0, 6)
    now[0] = 30.0
    assert limiter.log(logger, logging.INFO, "stage %d retry %d", 0, 7)  # nothing held: no count
    assert lines.messages == [
        "stage 0 retry 1",
        "stage 0 retry 6 (4 more like this in the last 12 s)",
        "stage 0 retry 7",
    ]


def test_other_templates_keys_and_loggers_are_limited_apart(limited):
    limiter, logger, _, _ = limited
    other = logging.getLogger("swarmtrain.test_log_repeats.other")
    assert limiter.log(logger, logging.INFO, "stage %d retry", 0, key=0)
    assert limiter.log(logger, logging.INFO, "stage %d retry", 1, key=1)
    assert limiter.log(logger, logging.INFO, "waiting for stage %d", 0)
    assert limiter.log(other, logging.INFO, "stage %d retry", 0, key=0)
    assert not limiter.log(logger, logging.INFO, "stage %d retry", 0, key=0)


def test_a_level_not_logged_is_not_counted(limited):
    limiter, logger, now, lines = limited
    assert limiter.log(logger, logging.INFO, "retry")
    assert not limiter.log(logger, logging.DEBUG, "retry")  # below the level: neither logged nor held
    now[0] = 11.0
    assert limiter.log(logger, logging.INFO, "retry")
    assert lines.messages == ["retry", "retry"]
