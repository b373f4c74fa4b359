"""The ranges every duration sqlaq stores or waits on must fit, and the integers it
stores; pure, no SQL, no clock.

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
* **The same bounds wherever a value is given.** A lease is at least :data:`MIN_LEASE`
  whether a worker's (``WorkerConfig.lease``, ``--lease``) or a handler's (``lease=``);
  a count stored as PostgreSQL's ``integer`` (a job's ``max_attempts``, a kind's
  ``concurrency`` and ``key_concurrency``) is at most :data:`INT4_MAX` whether given to
  an enqueue, a handler or a command. A value outside is refused where it is given
  (``ConfigError`` at the handler's registration), not when a worker first uses it.
* **Decisions the worker makes from a handler's policy are clamped**, never refused: a
  ``Snooze(timedelta.max)`` ("snooze for ever"), a tenacity wait that returns 1e30
  seconds, or a backoff that grows past the ceiling all become :data:`MAX_DURATION`, so
  the outcome is always storable and the job is never lost or stuck ``running``.
* **A payload is at most** :data:`DEFAULT_MAX_PAYLOAD_BYTES` **(1 MiB) of JSON** by
  default, measured as the UTF-8 bytes of its compact encoding (what is sent to the
  database). A bigger one is refused at enqueue with ``InvalidJobError`` (one line
  naming both sizes), before any statement is built, so no job is half-written. Every
  worker loads each payload it claims into memory, and the queue table is scanned and
  vacuumed for as long as the job lives there: large data belongs elsewhere (a file,
  object storage, a table of yours), with its reference in the payload.
* **The limit is one per process** (:func:`set_max_payload_bytes`, or
  ``SQLAQ_MAX_PAYLOAD_BYTES`` for the ``sqlaq`` and ``sqlaq-worker`` commands), not
  per call: it is a property of the deployment (what its workers and table can carry),
  not of one enqueue, and a per-call override would be a way around it at the one place
  it matters. It may be set from 2 bytes (``{}``) to 255 MiB (jsonb's own ceiling).
"""

from __future__ import annotations

from datetime import timedelta

from sqlaq.errors import ConfigError, InvalidJobError

__all__ = [
    "BIGINT_MAX",
    "BIGINT_MIN",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "INT4_MAX",
    "MAX_DURATION",
    "MIN_LEASE",
    "SMALLINT_MAX",
    "SMALLINT_MIN",
    "check_payload_size",
    "clamp_duration",
    "duration_from_seconds",
    "max_payload_bytes",
    "set_max_payload_bytes",
]

#: The longest duration sqlaq stores or waits on: 100 years (36,525 days).
MAX_DURATION = timedelta(days=36525)

_MAX_SECONDS = MAX_DURATION.total_seconds()

#: The shortest lease a worker or a handler takes: 100 ms (it is renewed every third of
#: it while the job runs).
MIN_LEASE = timedelta(milliseconds=100)

#: The smallest PostgreSQL ``smallint``: the lowest priority of a job.
SMALLINT_MIN = -(2**15)
#: The largest PostgreSQL ``smallint``: the highest priority of a job.
SMALLINT_MAX = 2**15 - 1
#: The largest PostgreSQL ``integer``: a job's ``max_attempts``, a kind's limits.
INT4_MAX = 2**31 - 1
#: The smallest PostgreSQL ``bigint``: below any job id.
BIGINT_MIN = -(2**63)
#: The largest PostgreSQL ``bigint``: job ids, row counts.
BIGINT_MAX = 2**63 - 1


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


#: The largest payload enqueued unless the process sets another limit: 1 MiB of JSON
#: (the UTF-8 bytes of its compact encoding).
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
#: The highest limit :func:`set_max_payload_bytes` takes: jsonb holds at most 255 MiB.
_PAYLOAD_CEILING = 255 * 1024 * 1024
_max_payload = DEFAULT_MAX_PAYLOAD_BYTES


def set_max_payload_bytes(limit: int | None) -> None:
    """Set this process's payload limit: the most bytes of JSON (UTF-8, compact
    encoding) a job's payload may have; None restores :data:`DEFAULT_MAX_PAYLOAD_BYTES`.

    Set it once at start-up, before enqueuing: it applies to every enqueue of the
    process (sync and async, single and batch, the ORM's ``Job``), none overrides it.

    Raises:
        ConfigError: *limit* is not an int from 2 to 255 MiB (267,386,880).
    """
    global _max_payload
    if limit is None:
        _max_payload = DEFAULT_MAX_PAYLOAD_BYTES
        return
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise ConfigError(f"the payload limit must be an int (bytes), got {type(limit).__name__}")
    if not 2 <= limit <= _PAYLOAD_CEILING:
        raise ConfigError(
            f"the payload limit must be from 2 to {_PAYLOAD_CEILING:,} bytes (255 MiB, "
            f"jsonb's ceiling), got {limit:,}"
        )
    _max_payload = limit


def max_payload_bytes() -> int:
    """This process's payload limit, in bytes (see :func:`set_max_payload_bytes`)."""
    return _max_payload


def check_payload_size(text: str, where: str = "payload") -> str:
    """Return *text*, a payload's JSON, if it is within this process's payload limit.

    Raises:
        InvalidJobError: its UTF-8 encoding is longer than the limit; the message names
            *where* (``payload``, ``payloads[3]``), both sizes and the way out.
    """
    limit = _max_payload
    if len(text) * 4 <= limit:  # a character is at most 4 bytes: the common case
        return text
    size = len(text) if text.isascii() else len(text.encode())
    if size > limit:
        raise InvalidJobError(
            f"{where} is {size:,} bytes of JSON; the limit is {limit:,}: store large data "
            "elsewhere and pass its reference, or raise the limit with "
            "sqlaq.set_max_payload_bytes()"
        )
    return text
