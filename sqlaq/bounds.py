"""The ranges every duration sqlaq stores or waits on must fit; pure, no SQL, no clock.

Decisions written down here:

* **One ceiling for every duration: 100 years** (:data:`MAX_DURATION`). A ``run_at``
  of ``now() + delay`` must be readable back by Python (``datetime`` ends at year 9999,
  while PostgreSQL's ``timestamptz`` goes on to 294276 AD: a row the server stores may
  be one psycopg cannot read), and a worker waits on timers (``threading.Event.wait``
  refuses more than ``threading.TIMEOUT_MAX``, about 292 years). 100 years keeps both
  safe with room to spare until the year 9899, and is longer than any real schedule.
* **Input beyond it is refused** (``InvalidJobError`` from the API, one line and exit 2
  from the commands): a delay, lease, interval or retention of more than 100 years is a
  typo, and saying so beats storing it.
* **Decisions the worker makes from a handler's policy are clamped**, never refused: a
  ``Snooze(timedelta.max)`` ("snooze for ever"), a tenacity wait that returns 1e30
  seconds, or a backoff that grows past the ceiling all become :data:`MAX_DURATION`, so
  the outcome is always storable and the job is never lost or stuck ``running``.
"""

from __future__ import annotations

from datetime import timedelta

__all__ = ["MAX_DURATION", "clamp_duration", "duration_from_seconds"]

#: The longest duration sqlaq stores or waits on: 100 years (36,525 days).
MAX_DURATION = timedelta(days=36525)

_MAX_SECONDS = MAX_DURATION.total_seconds()


def clamp_duration(value: timedelta) -> timedelta:
    """*value* brought into ``[0, MAX_DURATION]``."""
    if value < timedelta(0):
        return timedelta(0)
    return min(value, MAX_DURATION)


def duration_from_seconds(seconds: float) -> timedelta:
    """A :class:`~datetime.timedelta` of *seconds*, clamped to ``[0, MAX_DURATION]``.

    Never raises: NaN and negative values become zero, huge or infinite ones the
    ceiling (``timedelta(seconds=1e30)`` alone would raise ``OverflowError``).
    """
    if not seconds > 0:  # also NaN
        return timedelta(0)
    if seconds >= _MAX_SECONDS:
        return MAX_DURATION
    return timedelta(seconds=seconds)
