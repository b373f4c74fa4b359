"""What the dashboard reads: each function runs builders of :mod:`sqlaq.queries` on the
caller's connection and shapes the rows for a page or for the overview's JSON.

No web framework, no SQL of its own, nothing written (the actions are
:mod:`sqlaq.dashboard.actions`). Every time comes from the database's clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Row
from sqlalchemy.exc import OperationalError

from sqlaq import control, ops, queries
from sqlaq.registry import Registry
from sqlaq.schema import FINISHED_STATUSES, JobStatus

__all__ = [
    "ERROR_HEAD",
    "OUTCOMES",
    "SHOWN",
    "STATUSES",
    "WINDOWS",
    "Overview",
    "Schedule",
    "Workers",
    "WorkflowDrawing",
    "failure_groups",
    "job",
    "job_value",
    "jobs_page",
    "overview",
    "schedules",
    "workers",
    "workflow",
]

#: The plots' time ranges (hours) and the bucket of each: at most 180 points a series.
WINDOWS: Mapping[int, timedelta] = {
    1: timedelta(minutes=1),
    3: timedelta(minutes=1),
    6: timedelta(minutes=2),
    12: timedelta(minutes=5),
    24: timedelta(minutes=10),
}
#: Every job status, in :class:`~sqlaq.JobStatus` order: the columns of the counts.
STATUSES = tuple(s.value for s in JobStatus)
#: The outcomes of the throughput plot, in the order of its series.
OUTCOMES = tuple(s.value for s in (JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED))
_PERCENTILE_NAMES = tuple(f"p{round(p * 100)}" for p in queries.WAIT_PERCENTILES)
#: Characters of a payload, result or error a job's page shows at most; the whole
#: value is a download (:func:`job_value`).
SHOWN = 65_536
#: Characters of each job's error the jobs list reads (it shows the first line, cut).
ERROR_HEAD = 200


@dataclass(frozen=True)
class Overview:
    """The overview page: counts, per-queue health and the two plots' series.

    Attributes:
        now: The database's clock when it was read.
        hours: The plots' range (and the finished counts' window).
        bucket: The plots' bucket.
        counts: ``(queue, kind, {status: count})``: every pending job, and the jobs that
            finished within the range.
        totals: Jobs per status over *counts*.
        health: Per queue: ``queue, due, oldest_due_age, expired_leases,
            failed_last_hour``.
        paused: The paused queues, by name (a paused queue with no recent job is
            listed too).
        throughput: ``t`` (bucket starts, Unix seconds) and, per outcome, jobs finished
            per minute on average over each bucket.
        wait: ``t``, ``count`` and the wait's percentiles (``p50``...) in seconds;
            None where no job started in a bucket.
    """

    now: datetime
    hours: int
    bucket: timedelta
    counts: list[tuple[str, str, dict[str, int]]]
    totals: dict[str, int]
    health: list[Row[Any]]
    paused: dict[str, control.PausedQueue] = field(default_factory=dict)
    throughput: dict[str, list[float]] = field(default_factory=dict)
    wait: dict[str, list[float | None]] = field(default_factory=dict)

    def series(self) -> dict[str, Any]:
        """The plots' data as JSON-ready values."""
        return {
            "now": self.now.timestamp(),
            "hours": self.hours,
            "bucket_seconds": int(self.bucket.total_seconds()),
            "throughput": self.throughput,
            "wait": self.wait,
        }


def overview(conn: Connection, hours: int) -> Overview:
    """Read the overview over the last *hours* (a key of :data:`WINDOWS`)."""
    window, bucket = timedelta(hours=hours), WINDOWS[hours]
    now = conn.execute(queries.clock_stmt()).scalar_one()
    pivot: dict[tuple[str, str], dict[str, int]] = {}
    totals = dict.fromkeys(STATUSES, 0)
    for queue, kind, status, count in conn.execute(queries.overview_counts_stmt(window=window)):
        pivot.setdefault((queue, kind), {})[status] = count
        totals[status] = totals.get(status, 0) + count
    health = list(conn.execute(queries.overview_health_stmt()))
    paused = {p.queue: p for p in control.paused_queues(conn)}
    starts = _buckets(now, window, bucket)
    index = {start: i for i, start in enumerate(starts)}
    per_minute = 60 / bucket.total_seconds()
    throughput: dict[str, list[float]] = {"t": [float(s) for s in starts]}
    for outcome in OUTCOMES:
        throughput[outcome] = [0.0] * len(starts)
    stmt = queries.throughput_stmt(window=window, bucket=bucket)
    for start, status, count in conn.execute(stmt):
        at = index.get(int(start.timestamp()))
        if at is not None:
            throughput[status][at] = round(count * per_minute, 3)
    wait: dict[str, list[float | None]] = {"t": [float(s) for s in starts]}
    for name in ("count", *_PERCENTILE_NAMES):
        wait[name] = [None] * len(starts)
    for start, count, waits in conn.execute(
        queries.wait_percentiles_stmt(window=window, bucket=bucket)
    ):
        at = index.get(int(start.timestamp()))
        if at is not None:
            wait["count"][at] = count
            for name, value in zip(_PERCENTILE_NAMES, waits, strict=True):
                wait[name][at] = round(value.total_seconds(), 3)
    return Overview(
        now=now,
        hours=hours,
        bucket=bucket,
        counts=[(q, k, by) for (q, k), by in pivot.items()],
        totals=totals,
        health=health,
        paused=paused,
        throughput=throughput,
        wait=wait,
    )


def _buckets(now: datetime, window: timedelta, bucket: timedelta) -> list[int]:
    """Every bucket start (Unix seconds) from ``now - window`` to *now*, as the queries
    round them."""
    size = int(bucket.total_seconds())
    first = int((now - window).timestamp()) // size * size
    last = int(now.timestamp()) // size * size
    return list(range(first, last + 1, size))


@dataclass(frozen=True)
class JobsPage:
    """One page of the jobs list, newest first.

    Attributes:
        jobs: The rows (the columns of :func:`sqlaq.queries.jobs_list_stmt`).
        older: The id to pass as ``before`` for the next (older) page, or None.
        newer: The id to pass as ``after`` for the previous (newer) page, or None.
    """

    jobs: list[Row[Any]]
    older: int | None
    newer: int | None


def jobs_page(
    conn: Connection,
    *,
    statuses: Sequence[JobStatus],
    kind: str | None,
    queue: str | None,
    since: timedelta | None,
    limit: int,
    before: int | None = None,
    after: int | None = None,
) -> JobsPage:
    """One page of jobs matching the filters (those of ``sqlaq list``), by keyset:
    ids below *before*, or the *limit* ids just above *after*, never an OFFSET."""

    def find(after_id: int | None, newest_first: bool) -> list[Row[Any]]:
        stmt = queries.jobs_list_stmt(
            statuses=statuses,
            kind=kind,
            queue=queue,
            since=since,
            after_id=after_id,
            limit=limit + 1,
            newest_first=newest_first,
            error_head=ERROR_HEAD,
        )
        return list(conn.execute(stmt))

    if after is not None:
        rows = find(after, newest_first=False)
        more_newer = len(rows) > limit
        rows = rows[:limit][::-1]
        newer = rows[0].id if rows and more_newer else None
        return JobsPage(rows, older=rows[-1].id if rows else after + 1, newer=newer)
    rows = find(before, newest_first=True)
    older = rows[limit - 1].id if len(rows) > limit else None
    rows = rows[:limit]
    newer = rows[0].id if rows and before is not None else None
    return JobsPage(rows, older=older, newer=newer)


def job(conn: Connection, job_id: int) -> dict[str, Any] | None:
    """What job *job_id*'s page shows (None if there is no such job): its columns but
    the large ones, and ``payload_text``, ``result_text`` (None without a result) and
    ``error_text``, each at most :data:`SHOWN` characters, with ``payload_cut``,
    ``result_cut`` and ``error_cut`` saying which were cut. A payload or result shown
    whole is indented JSON; a cut one is the start of its JSON text."""
    row = conn.execute(queries.job_page_stmt(job_id=job_id, head=SHOWN + 1)).first()
    if row is None:
        return None
    data = dict(row._mapping)
    for name, head, indent in (
        ("payload", "payload_head", True),
        ("result", "result_head", True),
        ("error", "error_head", False),
    ):
        text, cut = _shown(data.pop(head), indent=indent)
        data[f"{name}_text"], data[f"{name}_cut"] = text, cut
    data["finished"] = data["status"] in FINISHED_STATUSES
    in_workflow = data.pop("has_dependents") or data["parent_ids"] is not None
    data["workflow"] = _bounded_workflow(conn, job_id) if in_workflow else None
    return data


#: How long a job's page waits for its workflow's walk (``statement_timeout``): an
#: old workflow in a large table is slow to walk (see docs/how-to/workflows.md); the
#: page then says so instead of hanging.
WORKFLOW_TIMEOUT = "2s"
_QUERY_CANCELED = "57014"


def _bounded_workflow(conn: Connection, job_id: int) -> WorkflowDrawing | str:
    """:func:`workflow`, or ``"timeout"`` if the walk took more than
    :data:`WORKFLOW_TIMEOUT` (in a savepoint: the page's other reads stand)."""
    try:
        with conn.begin_nested():
            conn.execute(queries.set_setting_stmt(name="statement_timeout", value=WORKFLOW_TIMEOUT))
            drawing = workflow(conn, job_id)
            conn.execute(queries.set_setting_stmt(name="statement_timeout", value="0"))
            return drawing
    except OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) != _QUERY_CANCELED:
            raise
        return "timeout"


#: Jobs of a workflow a job's page draws at most (the nearest to the job); the rest
#: are counted.
WORKFLOW_SHOWN = 60
# The drawing's geometry (SVG user units): a node's box, the gaps between layers
# (columns, left to right: parents before children) and between nodes of a layer.
_NODE_W, _NODE_H, _GAP_X, _GAP_Y, _PAD = 168, 40, 56, 14, 8
_LABEL = 18  # characters of a kind shown in a node (all of it in the node's title)


@dataclass(frozen=True)
class WorkflowNode:
    """A job drawn in a workflow: its box's top-left corner and what it says."""

    job_id: int
    kind: str
    label: str
    status: str
    parent_ids: tuple[int, ...]
    x: int
    y: int
    current: bool


@dataclass(frozen=True)
class WorkflowDrawing:
    """A job's workflow as its page draws it (an SVG made on the server, and a table).

    Attributes:
        nodes: The jobs shown, in dependency order; ``status`` reads ``waiting`` for a
            queued job still held for a parent.
        edges: ``(x1, y1, x2, y2)``: from a parent's box (right edge) to its child's
            (left edge), for each pair of jobs shown.
        width, height: The drawing's size.
        more: Jobs of the workflow not shown; ``more_exact`` False: at least that many.
        node_width, node_height: A node's box.
    """

    nodes: list[WorkflowNode]
    edges: list[tuple[int, int, int, int]]
    width: int
    height: int
    more: int
    more_exact: bool
    node_width: int = _NODE_W
    node_height: int = _NODE_H


def workflow(conn: Connection, job_id: int) -> WorkflowDrawing:
    """Job *job_id*'s workflow, laid out in layers: a job's layer is one more than its
    deepest parent's among the jobs shown (the roots first), its place in the layer
    its order by id."""
    found = ops.read_workflow(conn, job_id, limit=WORKFLOW_SHOWN)
    layer: dict[int, int] = {}
    for job in found.jobs:  # by id: every parent shown comes before its children
        layer[job.job_id] = 1 + max((layer[p] for p in job.parent_ids if p in layer), default=-1)
    rows: dict[int, int] = {}
    place: dict[int, tuple[int, int]] = {}
    for job in found.jobs:
        column = layer[job.job_id]
        row = rows.get(column, 0)
        rows[column] = row + 1
        place[job.job_id] = (
            _PAD + column * (_NODE_W + _GAP_X),
            _PAD + row * (_NODE_H + _GAP_Y),
        )
    nodes = [
        WorkflowNode(
            job_id=job.job_id,
            kind=job.kind,
            label=job.kind if len(job.kind) <= _LABEL else job.kind[: _LABEL - 1] + "\u2026",
            status="waiting" if job.waiting else job.status,
            parent_ids=job.parent_ids,
            x=place[job.job_id][0],
            y=place[job.job_id][1],
            current=job.job_id == job_id,
        )
        for job in found.jobs
    ]
    edges = [
        (
            place[parent][0] + _NODE_W,
            place[parent][1] + _NODE_H // 2,
            place[job.job_id][0],
            place[job.job_id][1] + _NODE_H // 2,
        )
        for job in found.jobs
        for parent in job.parent_ids
        if parent in place
    ]
    width = 2 * _PAD + (max(rows, default=0) + 1) * (_NODE_W + _GAP_X) - _GAP_X
    height = 2 * _PAD + max(rows.values(), default=0) * (_NODE_H + _GAP_Y) - _GAP_Y
    return WorkflowDrawing(nodes, edges, width, height, found.more, found.counted_all)


def _shown(head: str | None, *, indent: bool) -> tuple[str | None, bool]:
    """*head* (read one character longer than shown) as the page shows it, and whether
    it was cut."""
    if head is None:
        return None, False
    if len(head) > SHOWN:
        return head[:SHOWN], True
    if indent:
        return json.dumps(json.loads(head), indent=2, ensure_ascii=False), False
    return head, False


def job_value(conn: Connection, job_id: int, name: str) -> Row[Any] | None:
    """One of :data:`sqlaq.queries.LARGE_VALUES` of job *job_id*, whole, as text: a row
    whose ``value`` is it (None: the job has no such value), or None for no such job."""
    return conn.execute(queries.job_value_stmt(job_id=job_id, name=name)).first()


def failure_groups(
    conn: Connection, *, since: timedelta | None, kind: str | None = None, error: str | None = None
) -> list[Row[Any]]:
    """Failed jobs grouped by kind and first error line (see
    :func:`sqlaq.queries.failure_groups_stmt`), largest first, at most 200 groups."""
    stmt = queries.failure_groups_stmt(since=since, kind=kind, error=error, limit=200)
    return list(conn.execute(stmt))


@dataclass(frozen=True)
class Workers:
    """The workers page.

    Attributes:
        kinds: Per kind running or limited: ``kind, running, expired, workers,
            oldest, concurrency`` (the registry's limit, or None).
        workers: Per worker holding running jobs (see
            :func:`sqlaq.queries.running_workers_stmt`).
        rates: Per rate-limited kind with a start log: ``kind, logged, newest, recent,
            rate`` (the registry's, or None).
        alive: The workers' heartbeat rows (:func:`sqlaq.control.list_workers`).
    """

    kinds: list[dict[str, Any]]
    workers: list[Row[Any]]
    rates: list[dict[str, Any]]
    alive: list[control.WorkerInfo] = field(default_factory=list)


def workers(conn: Connection, registry: Registry | None) -> Workers:
    """Read the concurrency each kind uses, the workers holding jobs and the rate logs;
    with *registry*, beside each kind's limits (kinds limited but idle included)."""
    handlers = {h.kind: h for h in registry} if registry is not None else {}
    kinds = {row.kind: dict(row._mapping) for row in conn.execute(queries.running_by_kind_stmt())}
    for kind, handler in handlers.items():
        if handler.concurrency is not None and kind not in kinds:
            kinds[kind] = {"kind": kind, "running": 0, "expired": 0, "workers": 0, "oldest": None}
    for kind, values in kinds.items():
        limited = handlers.get(kind)
        values["concurrency"] = limited.concurrency if limited else None
    periods = {k: h.rate.period for k, h in handlers.items() if h.rate is not None}
    rates = []
    for row in conn.execute(queries.rate_logs_stmt(periods=periods)):
        values = dict(row._mapping)
        limited = handlers.get(row.kind)
        values["rate"] = limited.rate if limited else None
        rates.append(values)
    workers_ = list(conn.execute(queries.running_workers_stmt()))
    return Workers([kinds[k] for k in sorted(kinds)], workers_, rates, control.list_workers(conn))


@dataclass(frozen=True)
class Schedule:
    """One periodic schedule: its ``sqlaq_periodic`` row and, with a registry, what it
    declares. ``zone`` (the time zone the expression is read in) and ``next_slot`` are
    known only from the registry's schedule."""

    name: str
    last_slot: datetime | None
    updated_at: datetime | None
    expression: str | None = None
    zone: str | None = None
    kind: str | None = None
    next_slot: datetime | None = None


def schedules(conn: Connection, registry: Registry | None) -> list[Schedule]:
    """Every periodic schedule with a row, and with *registry* every one it declares
    (a declared schedule no worker has seen yet has no row)."""
    now = conn.execute(queries.clock_stmt()).scalar_one()
    rows = {row.name: row for row in conn.execute(queries.periodic_slots_stmt())}
    declared = {p.name: p for p in registry.periodics} if registry is not None else {}
    found = []
    for name in sorted(set(rows) | set(declared)):
        row, periodic = rows.get(name), declared.get(name)
        found.append(
            Schedule(
                name=name,
                last_slot=row.last_slot if row else None,
                updated_at=row.updated_at if row else None,
                expression=periodic.schedule.expression if periodic else None,
                zone=periodic.schedule.zone if periodic else None,
                kind=periodic.kind if periodic else None,
                next_slot=periodic.schedule.next_after(now) if periodic else None,
            )
        )
    return found
