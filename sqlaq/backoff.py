"""Backoff policies: attempt number -> interval. Pure: no clock, no SQL.

(Named ``backoff`` rather than ``retry``: ``sqlaq.retry`` is the manual-retry operation.)

The interval is added to the database's ``now()`` by the fail statement; Python never
computes the timestamp itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import timedelta

from sqlaq.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter, capped.

    The delay before attempt ``n + 1`` after attempt *n* failed is
    ``min(cap, base * factor ** (n - 1))``, then jittered: a uniformly random fraction
    of up to *jitter* of it is taken off (so retries of many jobs that failed together
    spread out instead of arriving together, and the cap is never exceeded).

    Args:
        base: The delay after the first failed attempt (before jitter).
        factor: How much each further attempt multiplies it.
        cap: The longest delay.
        jitter: The largest fraction taken off at random, 0 (none) to 1.

    Raises:
        ConfigError: a value is out of range.
    """

    base: timedelta = timedelta(seconds=1)
    factor: float = 2.0
    cap: timedelta = timedelta(hours=1)
    jitter: float = 0.25
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.base, timedelta) or self.base <= timedelta(0):
            raise ConfigError(f"backoff base must be a positive timedelta, got {self.base!r}")
        if not isinstance(self.cap, timedelta) or self.cap < self.base:
            raise ConfigError(f"backoff cap must be a timedelta >= base, got {self.cap!r}")
        if not self.factor >= 1:
            raise ConfigError(f"backoff factor must be >= 1, got {self.factor!r}")
        if not 0 <= self.jitter <= 1:
            raise ConfigError(f"backoff jitter must be between 0 and 1, got {self.jitter!r}")

    def __call__(self, attempt: int) -> timedelta:
        """Return the delay after failed attempt number *attempt* (1-based)."""
        exponent = max(attempt, 1) - 1
        cap = self.cap.total_seconds()
        try:
            seconds = min(cap, self.base.total_seconds() * self.factor**exponent)
        except OverflowError:
            seconds = cap
        seconds -= seconds * self.jitter * self.rng.random()
        return timedelta(seconds=seconds)


#: The backoff used when a handler names none: 1 s, 2 s, 4 s, ... up to an hour, -25 %.
DEFAULT_BACKOFF = Backoff()
