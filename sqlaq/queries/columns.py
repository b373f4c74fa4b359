"""The job's columns, in one table: every INSERT of a new job is built from it.

:data:`JOB_FIELDS` lists what a new job carries into its row, one row each: its bind
parameter, its ``enqueue_many`` array, whether COPY loads it. :func:`row_values` turns
it into the ``{column: expression}`` of an INSERT, in the table's column order, for
each statement's way of reading a field (a bound value, a column of ``unnest``, a cast
parameter); :func:`enqueue_params` and :func:`enqueue_uniform_params` give the values.
A new column of the job is one row here (and a field of :class:`~sqlaq.NewJob`): every
enqueue statement (one, debounced, ``unique_for``, many, uniform, COPY) then writes it.
The column lists statements return follow.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Integer, Interval, SmallInteger, Text, bindparam, cast, func
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP
from sqlalchemy.types import TypeEngine

from sqlaq.encoding import NewJob
from sqlaq.queries._common import _NOW, c
from sqlaq.schema import jobs


@dataclass(frozen=True, slots=True)
class JobField:
    """One value a new job carries into its row.

    Attributes:
        name: The field, and the column it fills (``delay`` fills none of its own: it
            is folded into ``run_at``); its bind parameter is ``b_<name>``.
        type: The type of one job's value.
        attr: The :class:`~sqlaq.NewJob` attribute it is read from; None: given beside
            the jobs (``headers``, one value for every job of an enqueue).
        many: The array parameter of :func:`~sqlaq.queries.enqueue_many_stmt`; None:
            not an array there (the payloads travel as one JSON array, the headers
            as one value).
        json: Sent as JSON text and cast to ``jsonb``.
        typed_bind: psycopg renders the bind with its type (``%(b_kind)s::VARCHAR``);
            false for an interval, which a SELECT list must cast for PostgreSQL to
            know it.
        copy: :func:`~sqlaq.queries.enqueue_copy_stmt` loads it (COPY sets no delay,
            dedupe key, timeout or headers).
    """

    name: str
    type: TypeEngine[Any]
    attr: str | None
    many: str | None = None
    json: bool = False
    typed_bind: bool = True
    copy: bool = False

    @property
    def bind(self) -> str:
        """The name of its bind parameter: ``b_<name>``."""
        return f"b_{self.name}"

    def of(self, jobs: Iterable[NewJob]) -> list[Any]:
        """This field's value of each of *jobs*, in order (an ``enqueue_many`` array)."""
        if self.attr is None:
            raise ValueError(f"{self.name} is not a field of a job")
        return list(map(operator.attrgetter(self.attr), jobs))


#: What a new job carries into its row, in ``enqueue_many``'s ``unnest`` order.
JOB_FIELDS = (
    JobField("queue", Text(), "queue", many="b_queues", copy=True),
    JobField("kind", Text(), "kind", many="b_kinds", copy=True),
    JobField("payload", Text(), "payload_json", json=True, copy=True),
    JobField("priority", SmallInteger(), "priority", many="b_priorities", copy=True),
    JobField("delay", Interval(), "delay", many="b_delays", typed_bind=False),
    JobField("max_attempts", Integer(), "max_attempts", many="b_max_attempts", copy=True),
    JobField("dedupe_key", Text(), "dedupe_key", many="b_dedupe_keys"),
    JobField("run_at", TIMESTAMP(timezone=True), "run_at", many="b_run_ats"),
    JobField("timeout", Interval(), "timeout", many="b_timeouts", typed_bind=False),
    JobField("key", Text(), "key", many="b_keys", copy=True),
    JobField("headers", Text(), None, json=True),
)
_FIELD = {f.name: f for f in JOB_FIELDS}
_FROM_JOB = [f for f in JOB_FIELDS if f.attr is not None]
_JOB_BINDS = [f.bind for f in _FROM_JOB]
# One C call reads every field of a job (enqueue_params runs once per enqueue).
_JOB_VALUES = operator.attrgetter(*(f.attr for f in _FROM_JOB if f.attr))


def enqueue_params(job: NewJob, *, headers: str | None = None) -> dict[str, Any]:
    """The bind values of :func:`~sqlaq.queries.enqueue_stmt` for *job* (and its
    *headers*, JSON text: what :func:`sqlaq.tracing.capture` returns)."""
    # Both lists come from _FROM_JOB: the same length by construction.
    params = dict(zip(_JOB_BINDS, _JOB_VALUES(job)))  # noqa: B905
    params["b_headers"] = headers
    return params


def enqueue_uniform_params(
    job: NewJob, payloads_json: str, *, headers: str | None = None
) -> dict[str, Any]:
    """The bind values of :func:`~sqlaq.queries.enqueue_uniform_stmt`: every column but
    the payload from *job*, the payloads as one JSON array text (one element per job,
    in order), and the *headers* (JSON text) of every job."""
    params = enqueue_params(job, headers=headers)
    del params["b_dedupe_key"], params["b_payload"]
    params["b_payloads"] = payloads_json
    return params


def bound(field: JobField, values: Mapping[str, Any]) -> ColumnElement[Any]:
    """*field* as its bind parameter, valued from *values* (``b_<name>`` -> value);
    JSON text cast to ``jsonb``."""
    value = bindparam(field.bind, values.get(field.bind), field.type)
    return cast(value, JSONB) if field.json else value


def row_values(
    read: Callable[[JobField], ColumnElement[Any]],
    *,
    run_at: ColumnElement[Any] | None = None,
    skip: Collection[str] = (),
    cast_untyped: bool = False,
) -> dict[str, ColumnElement[Any]]:
    """The columns a new job's INSERT writes, in the table's column order, as
    ``{column: expression}``.

    Each field's expression is ``read(field)``; ``run_at`` is *run_at* if given, else
    ``coalesce(<run_at>, now() + <delay>)`` (an absolute time when the job has one, else
    its delay from the database clock). *skip* leaves columns out (a statement that
    writes no dedupe key). With *cast_untyped*, a column value whose bind carries no
    type of its own is cast to its type (a SELECT list, where PostgreSQL cannot infer
    it from the column).
    """
    row: dict[str, ColumnElement[Any]] = {}
    for column in jobs.c:
        name = column.name
        if name in skip:
            continue
        if name == "run_at":
            row[name] = (
                run_at
                if run_at is not None
                else func.coalesce(read(_FIELD["run_at"]), _NOW + read(_FIELD["delay"]))
            )
        elif (field := _FIELD.get(name)) is not None:
            value = read(field)
            if cast_untyped and not field.typed_bind:
                value = cast(value, field.type)
            row[name] = value
    return row


#: Columns :func:`~sqlaq.queries.enqueue_copy_stmt` loads, in this order; ``run_at`` and
#: ``created_at`` keep their default, ``now()``.
COPY_COLUMNS = tuple(f.name for f in JOB_FIELDS if f.copy)
#: A job's row for COPY: its values of :data:`COPY_COLUMNS`, in that order.
copy_row: Callable[[NewJob], tuple[Any, ...]] = operator.attrgetter(
    *(f.attr for f in JOB_FIELDS if f.copy and f.attr)
)


#: Columns a claim returns, in this order.
CLAIM_COLUMNS = (
    c.id,
    c.queue,
    c.kind,
    c.payload,
    c.priority,
    c.status,
    c.attempts,
    c.max_attempts,
    c.lease_token,
    c.run_at,
    c.created_at,
    c.headers,
    c.timeout,
)

#: Columns :func:`job_outcome_stmt` and :func:`watch_job_stmt` return, in this order.
OUTCOME_COLUMNS = (c.id, c.status, c.result, c.last_error, c.finished_at)
