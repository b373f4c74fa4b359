"""Per-kind limits: ``Rate`` and the arithmetic of a limited claim. Pure: no SQL.

A kind may have a global concurrency limit (at most N jobs of it running at once,
across every worker and process) and a rate (at most N starts per period, likewise).
Both are enforced by the database at claim time, by :func:`sqlaq.claim_limited`:

1. ``pg_advisory_xact_lock`` on the kind, in a statement of its own, so that the
   statements after it see every claim of the kind committed before;
2. one read of the kind's state: its live leases (running rows whose lease has not
   expired, through a partial index on running rows) and, from its start log
   (``sqlaq_rates``: the timestamps of its latest starts, at most the rate's count of
   them), how many starts count now;
3. a claim of at most ``min(wanted, concurrency - running, rate.count - recent starts)``
   jobs of that kind (:func:`allowance`, below);
4. for a rated kind, the new starts appended to the log, which is trimmed to the starts
   that still count (at most the rate's count). The log never leaves the database: a
   claim costs the same whatever the count.

The lock is released at commit, when the claimed rows become visible to the next
holder. Jobs held back stay queued and keep their attempts: a claim that does not take
them does not touch them.

Decisions written down here:

* The limit counts *live leases*. A job whose lease expired (its worker died) no longer
  holds a slot: it is due again, and the limited claim itself picks it up.
* A rate is a sliding window over start times on the database's clock (the claiming
  transaction's ``now()``, also written to the job's ``attempted_at``): in any window of
  one period, at most ``count`` jobs of the kind start. Not a token bucket: no burst
  beyond the count, ever.
* Limits belong to the registry, so every worker that runs a limited kind must declare
  the same limits (the same code does). A worker that does not know a kind is limited
  claims it like any other, and so does a plain :func:`sqlaq.claim`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlaq.bounds import MAX_DURATION
from sqlaq.errors import ConfigError, shown

__all__ = ["MAX_RATE_COUNT", "Allowance", "Rate", "allowance"]

#: The largest ``count`` of a rate: the start log holds up to that many timestamps.
MAX_RATE_COUNT = 10_000

_UNITS = {
    "ms": timedelta(milliseconds=1),
    "s": timedelta(seconds=1),
    "m": timedelta(minutes=1),
    "h": timedelta(hours=1),
    "d": timedelta(days=1),
}
_RATE = re.compile(r"\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*(ms|s|m|h|d)\s*")


@dataclass(frozen=True, slots=True)
class Rate:
    """At most *count* job starts per *period*, across all workers.

    Build it with :meth:`parse` (``Rate.parse("5/s")``) or directly
    (``Rate(5, timedelta(seconds=1))``); ``registry.handler(..., rate="5/s")`` accepts
    either.

    Raises:
        ConfigError: *count* is not an int from 1 to :data:`MAX_RATE_COUNT`, or *period*
            is not a timedelta from a millisecond to 100 years.
    """

    count: int
    period: timedelta

    def __post_init__(self) -> None:
        count = self.count
        if isinstance(count, bool) or not isinstance(count, int):
            raise ConfigError(f"a rate's count must be an int, got {shown(count)}")
        if not 1 <= count <= MAX_RATE_COUNT:
            raise ConfigError(f"a rate's count must be 1 to {MAX_RATE_COUNT}, got {shown(count)}")
        if not isinstance(self.period, timedelta) or self.period < _UNITS["ms"]:
            raise ConfigError(
                f"a rate's period must be a timedelta of 1ms or more, got {shown(self.period)}"
            )
        if self.period > MAX_DURATION:
            raise ConfigError(
                f"a rate's period must be at most 100 years ({MAX_DURATION.days}d), "
                f"got {self.period.days} days"
            )

    @classmethod
    def parse(cls, text: str) -> Rate:
        """``"1/s"``, ``"5/s"``, ``"100/m"``, ``"1000/h"``, ``"10/d"``, or a period with
        a number: ``"10/30s"``, ``"3/2.5m"``.

        Raises:
            ConfigError: not a rate; the message shows the accepted forms.
        """
        match = _RATE.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ConfigError(
                f"invalid rate {shown(text)}: use COUNT/UNIT or COUNT/NUMBERUNIT with a unit of "
                "ms, s, m, h or d, e.g. '5/s', '100/m', '10/30s'"
            )
        count, number, unit = match.groups()
        if len(count) > len(str(MAX_RATE_COUNT)):  # int() of thousands of digits raises
            raise ConfigError(f"a rate's count must be 1 to {MAX_RATE_COUNT}, got {shown(count)}")
        seconds = _UNITS[unit].total_seconds() * float(number or 1)
        if seconds > MAX_DURATION.total_seconds():  # timedelta itself would overflow
            raise ConfigError(
                f"invalid rate {shown(text)}: its period must be at most 100 years "
                f"({MAX_DURATION.days}d)"
            )
        return cls(int(count), _UNITS[unit] * float(number or 1))

    def __str__(self) -> str:
        return f"{self.count}/{self.period.total_seconds():g}s"


@dataclass(frozen=True, slots=True)
class Allowance:
    """How many jobs of a limited kind a claim may take now, and why not more.

    Attributes:
        count: Jobs it may claim (0 or more).
        full: The concurrency limit is reached, this claim's jobs included (a running
            job must end before another may start).
        rate_wait: When the rate holds starts back: how long until the oldest counted
            start leaves the window. None when the rate is not what stops it.
    """

    count: int
    full: bool
    rate_wait: timedelta | None


def allowance(
    wanted: int,
    *,
    concurrency: int | None,
    running: int,
    rate: Rate | None,
    recent: int,
    pivot: datetime | None,
    now: datetime,
) -> Allowance:
    """How many of *wanted* jobs a limited kind lets a claim take (see :class:`Allowance`).

    Args:
        wanted: The claim's own limit (free slots in the worker).
        concurrency: The kind's concurrency limit, or None.
        running: The kind's live leases.
        rate: The kind's rate, or None.
        recent: How many of its logged starts count against the rate now: those less
            than a period old, and any later than *now* (a transaction that started
            after this one may have taken the lock first and logged them).
        pivot: The ``rate.count``-th newest counted start, else the oldest counted one,
            else None: the start that must leave the window before one more may start
            once this claim has filled the log.
        now: The claiming transaction's clock.
    """
    by_concurrency = wanted if concurrency is None else max(0, concurrency - running)
    by_rate = wanted if rate is None else max(0, rate.count - recent)
    count = min(wanted, by_concurrency, by_rate)
    rate_wait = None
    if rate is not None and count == by_rate < wanted:
        # This claim fills the log (its starts are logged at *now*): the next place
        # opens when the pivot leaves the window; with an empty log, one period on.
        leaves = (pivot if pivot is not None else now) + rate.period
        rate_wait = max(timedelta(0), leaves - now)
    full = concurrency is not None and running + count >= concurrency
    return Allowance(count, full, rate_wait)
