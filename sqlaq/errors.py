"""The whole sqlaq error tree.

::

    SqlaqError
    ├── ConfigError (ValueError)        bad worker options or CLI flags
    ├── InvalidJobError (ValueError)    enqueue input rejected before any SQL ran
    ├── LeaseLostError                  a fenced update matched no row; .job_ids
    ├── SchemaOutOfDateError            the database is not at sqlaq's head
    ├── DatabaseUnavailableError        a worker could not reach its database at start
    ├── PermanentError                  raised by a handler: fail now, no retry
    ├── JobTimeoutError (TimeoutError)  an attempt ran past its handler's timeout
    ├── HandlerProcessDied              the process running a handler died before it returned
    └── Snooze                          raised by a handler: run again later, no attempt used

SQLAlchemy's own exceptions (``sqlalchemy.exc.*``) are never wrapped: they carry the
driver's error in ``.orig``. Only errors with a meaning in the queue's domain are raised
from here.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

#: Bad values longer than this are cut in messages.
_SHOWN_LENGTH = 80


def shown(value: object) -> str:
    """``repr(value)`` for an error message: cut to 80 characters, and safe for what
    ``repr`` itself refuses (an int of more than 4,300 digits) or fails on."""
    if isinstance(value, int) and value.bit_length() > 1000:
        return f"<an int of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except Exception:
        return f"<a {type(value).__name__}>"
    return text if len(text) <= _SHOWN_LENGTH else text[: _SHOWN_LENGTH - 3] + "..."


def one_line(error: object) -> str:
    """*error*'s text on one line, for a log line or a command's message (a driver's
    messages span several)."""
    return " ".join(str(error).split())


class SqlaqError(Exception):
    """Base class of every error sqlaq raises on purpose."""


class ConfigError(SqlaqError, ValueError):
    """A worker option, CLI flag or environment variable has an unusable value."""


class InvalidJobError(SqlaqError, ValueError):
    """Enqueue input was rejected before any SQL ran; nothing was written.

    The message names the field, what was expected, and the fix.
    """


class LeaseLostError(SqlaqError):
    """A fenced update (complete, fail, extend) matched no row.

    The job's lease expired and the job was claimed again (by another worker or by this
    one), was cancelled, or was finished. Nothing was changed for the jobs listed in
    :attr:`job_ids`; any other job of the same call was updated as asked.
    """

    def __init__(self, job_ids: Iterable[int]) -> None:
        self.job_ids: tuple[int, ...] = tuple(job_ids)
        ids = ", ".join(str(i) for i in self.job_ids)
        super().__init__(
            f"lease lost for job(s) {ids}: the lease expired and the job was claimed again, "
            "cancelled or finished; nothing was changed for them"
        )

    @property
    def job_id(self) -> int:
        """The first (usually the only) job whose lease was lost."""
        return self.job_ids[0]


class SchemaOutOfDateError(SqlaqError):
    """The database's sqlaq schema is not at the revision this sqlaq needs."""


class DatabaseUnavailableError(SqlaqError):
    """A worker's database stayed unavailable (a transient fault: refused or dropped
    connections, a server starting up or shutting down) for its whole ``start_timeout``.

    ``sqlaq-worker`` exits 1 on it (worth restarting later), not 2 (a usage error).
    """


class PermanentError(SqlaqError):
    """Raised by a handler to fail its job at once, without retrying."""


class JobTimeoutError(SqlaqError, TimeoutError):
    """An attempt ran past its handler's ``timeout``: what its ``last_error`` names.

    Never raised into a sync handler (Python cannot interrupt a thread); an ``async``
    handler is cancelled at the deadline. Retried per the handler's policy like any
    failure.
    """


class HandlerProcessDied(SqlaqError):
    """The child process running a handler (``executor="process"``) died before it
    returned: killed by a signal (the kernel's out-of-memory killer, an operator's
    ``kill -9``), a crash in C code, or ``os._exit``. What its attempt's ``last_error``
    names; retried per the handler's policy like any failure. The worker's other
    children and jobs go on.
    """


class Snooze(SqlaqError):
    """Raised by a handler to run its job again after *delay*, without using an attempt.

    For work that is not ready yet (a rate-limited API said "later", a file not yet
    uploaded): the job goes back to ``queued`` at ``now() + delay`` and its attempt is
    not counted. Nothing is written to ``last_error``.

    Args:
        delay: How long to wait; any non-negative ``timedelta``. One longer than
            :data:`sqlaq.bounds.MAX_DURATION` (100 years), ``timedelta.max`` included
            ("snooze for ever"), is brought down to it when the job is written, never
            refused.

    Raises:
        InvalidJobError: *delay* is not a non-negative timedelta.
    """

    def __init__(self, delay: timedelta) -> None:
        if not isinstance(delay, timedelta) or delay < timedelta(0):
            raise InvalidJobError(
                f"Snooze needs a non-negative datetime.timedelta, got {shown(delay)}"
            )
        self.delay = delay
        super().__init__(f"snoozed for {delay}")

    def __reduce__(self) -> tuple[type[Snooze], tuple[timedelta]]:
        # Pickled by its delay (a handler in a child process raises it to the worker).
        return (type(self), (self.delay,))
