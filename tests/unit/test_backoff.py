"""Backoff: exponential, capped, jittered; pure (no clock)."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from sqlaq import Backoff, ConfigError


def test_backoff_grows_exponentially_without_jitter() -> None:
    backoff = Backoff(base=timedelta(seconds=1), factor=2, cap=timedelta(hours=1), jitter=0)
    assert [backoff(n).total_seconds() for n in range(1, 6)] == [1, 2, 4, 8, 16]


def test_backoff_is_capped_even_for_huge_attempts() -> None:
    backoff = Backoff(base=timedelta(seconds=1), cap=timedelta(minutes=5), jitter=0)
    assert backoff(20) == timedelta(minutes=5)
    assert backoff(10_000) == timedelta(minutes=5)  # no OverflowError


def test_backoff_jitter_spreads_delays_below_the_undisturbed_value() -> None:
    backoff = Backoff(base=timedelta(seconds=10), jitter=0.5, rng=random.Random(7))
    delays = [backoff(3).total_seconds() for _ in range(200)]
    assert all(20 <= d <= 40 for d in delays)
    assert len(set(delays)) > 150
    assert min(delays) < 25
    assert max(delays) > 35


def test_jittered_backoff_never_exceeds_the_cap() -> None:
    backoff = Backoff(cap=timedelta(seconds=30), jitter=1)
    assert all(backoff(n) <= timedelta(seconds=30) for n in range(1, 50))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base": timedelta(0)}, "base must be a positive timedelta"),
        ({"cap": timedelta(milliseconds=1)}, "cap must be a timedelta >= base"),
        ({"factor": 0.5}, "factor must be >= 1"),
        ({"jitter": 1.5}, "jitter must be between 0 and 1"),
    ],
)
def test_backoff_rejects_bad_settings(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Backoff(**kwargs)  # type: ignore[arg-type]
