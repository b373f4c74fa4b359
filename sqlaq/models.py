"""The ORM-mapped :class:`Job` over :data:`sqlaq.jobs`.

``session.add(Job(kind="send_email", payload={"user_id": 7}))`` enqueues in the same
flush and transaction as the host's own models, even though the host's models live in
another declarative registry. Host foreign keys to jobs must use
``ForeignKey(sqlaq.jobs.c.id, ondelete="SET NULL")`` (an object, not a string): the
string form is resolved in the host's MetaData, which does not hold ``sqlaq_jobs``. The
``ondelete`` says what retention does to the host's row when it deletes the job
(``"SET NULL"`` keeps it, ``"CASCADE"`` deletes it); without one, retention leaves the
referenced job in place and warns.

Attribute values are validated as they are set, with the same rules as
:func:`sqlaq.enqueue`, so a bad job raises :class:`~sqlaq.errors.InvalidJobError` at
construction, never at flush.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from sqlalchemy.orm import DeclarativeBase, Mapped, validates

from sqlaq.bounds import INT4_MAX, SMALLINT_MAX, SMALLINT_MIN, check_payload_size
from sqlaq.encoding import (
    check_dedupe_key,
    check_duration,
    check_int,
    check_key,
    check_name,
    check_run_at,
    encode_payload,
    plain_payload,
)
from sqlaq.errors import InvalidJobError
from sqlaq.schema import jobs, metadata

_WORKFLOW_ERROR = (
    "Job({what}=...) is not supported: enqueue a job that waits for others with "
    "sqlaq.enqueue(session, kind, payload, after=[ids], on_parent_failure=...) (or "
    "sqlaq.chain/group/chord/batch), in the same session and transaction"
)


class _Base(DeclarativeBase):
    metadata = metadata


class Job(_Base):
    """One row of ``sqlaq_jobs``, mapped for use in an ORM Session.

    Only ``kind`` is required; everything else has the table's default (queue
    ``'default'``, payload ``{}``, due now, five attempts). ``eager_defaults`` loads the
    server-generated ``id``, ``status`` and timestamps at flush.

    For a ``dedupe_key`` use :func:`sqlaq.enqueue` on the session instead: the ORM's
    INSERT has no ``ON CONFLICT``, so a duplicate would raise IntegrityError at flush and
    abort the whole transaction, while ``enqueue`` reports the existing job and leaves
    the transaction usable. The same goes for debounce and ``unique_for``: they exist
    only as :func:`sqlaq.enqueue` arguments (``debounce_key`` cannot be set here), and so do
    workflows (``after=``, :func:`sqlaq.chain` and the other shapes).

    ``timeout`` (a positive ``timedelta``, at most 100 years) is this job's attempt
    timeout, over its handler's (see "Timeouts" in the README). ``key`` (1 to 255
    characters) is what per-key limits and strict order count over (see
    ``docs/how-to/tenants.md``).

    A job that waits for others is enqueued with ``sqlaq.enqueue(session, kind,
    payload, after=[ids])`` (or a shape: :func:`sqlaq.chain`...), which runs in the
    session's transaction too: ``Job(after=...)``, and setting ``parent_ids``,
    ``has_dependents`` or ``on_parent_failure``, raise
    :class:`~sqlaq.errors.InvalidJobError` at once. A waiting job needs its parents
    flagged and locked before its INSERT and an edge row per parent after it; a
    plain INSERT of ``parent_ids`` would make a job that runs at once and that no
    parent releases.
    """

    __table__ = jobs
    __mapper_args__ = {"eager_defaults": True}

    id: Mapped[int]
    queue: Mapped[str]
    kind: Mapped[str]
    payload: Mapped[dict[str, Any]]
    status: Mapped[str]
    priority: Mapped[int]
    run_at: Mapped[datetime]
    attempts: Mapped[int]
    max_attempts: Mapped[int]
    locked_by: Mapped[UUID | None]
    lease_token: Mapped[UUID | None]
    last_error: Mapped[str | None]
    dedupe_key: Mapped[str | None]
    created_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    attempted_at: Mapped[datetime | None]
    #: The handler's return value (decoded JSON), or None; see :func:`sqlaq.result`.
    result: Mapped[Any]
    awaited: Mapped[bool]
    #: What the enqueuer sent beside the payload (the trace context), or None.
    headers: Mapped[dict[str, Any] | None]
    #: A debounced job's key (set by ``enqueue(..., debounce=...)`` only).
    debounce_key: Mapped[str | None]
    #: This job's attempt timeout, over its handler's; None: the handler's.
    timeout: Mapped[timedelta | None]
    #: Another job waits for this one (set by ``enqueue(..., after=...)`` and the
    #: workflow shapes; read-only here, like the two below).
    has_dependents: Mapped[bool]
    #: What this job does when a parent fails: ``cancel`` (None), ``run`` or ``fail``.
    on_parent_failure: Mapped[str | None]
    #: The jobs this one was enqueued to wait for, or None.
    parent_ids: Mapped[list[int] | None]
    #: The job's key (a tenant, an account): what its handler's ``key_concurrency``
    #: and ``ordered`` count over; None: no key.
    key: Mapped[str | None]

    def __init__(self, **kwargs: Any) -> None:
        if "kind" not in kwargs:
            raise InvalidJobError("Job needs a kind: Job(kind='send_email', payload={...})")
        if "after" in kwargs:
            raise InvalidJobError(_WORKFLOW_ERROR.format(what="after"))
        super().__init__(**kwargs)

    @validates("parent_ids", "has_dependents", "on_parent_failure")
    def _refuse_workflow(self, key: str, value: Any) -> Any:
        if value is not None and value is not False:
            raise InvalidJobError(_WORKFLOW_ERROR.format(what=key))
        return value

    @validates("run_at")
    def _validate_run_at(self, key: str, value: Any) -> Any:
        # An absolute time must say its zone (a naive one would be a guess); SQL
        # expressions (func.now() + interval: the database clock) are fine too.
        if isinstance(value, datetime):
            return check_run_at(value)
        return value

    @validates("kind", "queue")
    def _validate_name(self, key: str, value: str) -> str:
        return check_name(key, value)

    @validates("payload")
    def _validate_payload(self, key: str, value: dict[str, Any] | None) -> dict[str, Any]:
        # The column's own JSON serializer runs at flush: hand it plain values, within
        # the process's payload limit (measured as enqueue measures it). None is {} here
        # as in sqlaq.enqueue and NewJob.
        plain = plain_payload({} if value is None else value)
        check_payload_size(encode_payload(plain))
        return plain

    @validates("priority")
    def _validate_priority(self, key: str, value: int) -> int:
        return check_int(key, value, SMALLINT_MIN, SMALLINT_MAX)

    @validates("max_attempts")
    def _validate_max_attempts(self, key: str, value: int) -> int:
        return check_int(key, value, 1, INT4_MAX)

    @validates("dedupe_key")
    def _validate_dedupe_key(self, key: str, value: str | None) -> str | None:
        return None if value is None else check_dedupe_key(value)

    @validates("key")
    def _validate_key(self, key: str, value: str | None) -> str | None:
        return None if value is None else check_key(value)

    @validates("timeout")
    def _validate_timeout(self, key: str, value: timedelta | None) -> timedelta | None:
        return None if value is None else check_duration(key, value, allow_zero=False)

    @validates("debounce_key")
    def _validate_debounce_key(self, key: str, value: str | None) -> str | None:
        if value is not None:
            raise InvalidJobError(
                "debounce_key is set by sqlaq.enqueue(session, ..., debounce_key=..., "
                "debounce=...) only: the ORM's INSERT cannot update the queued twin"
            )
        return value

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, kind={self.kind!r}, status={self.status!r})"
