"""The whole sqlaq error tree.

::

    SqlaqError
    ├── ConfigError (ValueError)        bad worker options or CLI flags
    ├── InvalidJobError (ValueError)    enqueue input rejected before any SQL ran
    ├── LeaseLostError                  a fenced update matched no row; .job_ids
    ├── SchemaOutOfDateError            the database is not at sqlaq's head
    └── PermanentError                  raised by a handler: fail now, no retry

SQLAlchemy's own exceptions (``sqlalchemy.exc.*``) are never wrapped: they carry the
driver's error in ``.orig``. Only errors with a meaning in the queue's domain are raised
from here.
"""

from __future__ import annotations

from collections.abc import Iterable


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


class PermanentError(SqlaqError):
    """Raised by a handler to fail its job at once, without retrying."""
