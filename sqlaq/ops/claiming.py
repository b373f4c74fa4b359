"""Claim: due jobs under a lease, and the claim of a limited kind (concurrency, rate)."""

from __future__ import annotations

import operator
import threading
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

from sqlalchemy import ColumnElement

from sqlaq import queries
from sqlaq.drive import AUTOCOMMIT, Plan, operation, plan_of
from sqlaq.encoding import (
    check_duration,
    check_name,
    slot_setters,
)
from sqlaq.errors import ConfigError, InvalidJobError, shown
from sqlaq.lease import Lease
from sqlaq.limits import Rate, allowance
from sqlaq.ops._citus import DISTRIBUTED, refuse
from sqlaq.ops._common import _NIL, DEFAULT_LEASE, _check_positive, on_first_use
from sqlaq.option import Weights
from sqlaq.queries import FULL_CLAIM, ClaimPosition
from sqlaq.queries import citus as citus_queries
from sqlaq.records import ClaimedJob, LimitedClaim
from sqlaq.schema import (
    DEFAULT_QUEUE,
)

_CLAIM = queries.claim_stmt(queue="_", worker_id=_NIL, limit=1, lease=DEFAULT_LEASE)

_CLAIM_EXCLUDING = queries.claim_stmt(
    queue="_", worker_id=_NIL, limit=1, lease=DEFAULT_LEASE, exclude_kinds=["_"]
)

_CLAIM_BOUNDED = queries.claim_stmt(
    queue="_", worker_id=_NIL, limit=1, lease=DEFAULT_LEASE, bounded=True
)

_CLAIM_BOUNDED_EXCLUDING = queries.claim_stmt(
    queue="_", worker_id=_NIL, limit=1, lease=DEFAULT_LEASE, exclude_kinds=["_"], bounded=True
)

# The forms of a limited kind's claim (sqlaq.claim_limited), the fair claim and Citus's:
# built on first use (a plain worker takes none of them).
_claim_kind_stmt = on_first_use(
    queries.claim_stmt, queue="_", worker_id=_NIL, limit=1, lease=DEFAULT_LEASE, kind="_"
)

_lock_kind_stmt = on_first_use(queries.lock_kind_stmt, kind="_")

_kind_state_stmt = on_first_use(queries.kind_limit_state_stmt, kind="_", rate=None)

_record_starts_stmt = on_first_use(
    queries.record_starts_stmt, kind="_", rate=Rate(1, DEFAULT_LEASE), started=1
)

_key_running_stmt = on_first_use(queries.key_running_stmt, kind="_")

_claim_ids_stmt = on_first_use(
    queries.claim_stmt, queue="_", worker_id=_NIL, limit=1, lease=DEFAULT_LEASE, kind="_", ids=True
)

_keyed_candidates_stmt = on_first_use(queries.keyed_candidates_stmt, ordered=False)

_claim_fair_stmt = on_first_use(queries.fair_claim_stmt)

_claim_fair_excluding_stmt = on_first_use(queries.fair_claim_stmt, exclude_kinds=True)

_first_due_stmt = on_first_use(queries.first_due_stmt, queue="_")

_first_due_excluding_stmt = on_first_use(queries.first_due_stmt, queue="_", exclude_kinds=["_"])

_ordered_candidates_stmt = on_first_use(queries.keyed_candidates_stmt, ordered=True)

# The claims of a job table distributed on Citus (router statements, see
# sqlaq.queries.citus): plain, excluding kinds, one kind's.
_citus_claim_stmt = on_first_use(citus_queries.citus_claim_stmt)

_citus_claim_excluding_stmt = on_first_use(citus_queries.citus_claim_stmt, exclude_kinds=True)

_citus_claim_kind_stmt = on_first_use(citus_queries.citus_claim_stmt, kind=True)

_citus_claim_ids_stmt = on_first_use(citus_queries.citus_claim_stmt, kind=True, ids=True)

# Strict order per key on Citus: within the queue (one shard's read).
_citus_ordered_candidates_stmt = on_first_use(
    queries.keyed_candidates_stmt, ordered=True, per_queue=True
)


@operation
def claim(
    *,
    worker_id: UUID,
    queue: str = DEFAULT_QUEUE,
    limit: int = 1,
    lease: timedelta = DEFAULT_LEASE,
    exclude_kinds: Collection[str] = (),
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
) -> Plan[list[ClaimedJob]]:
    """Claim up to *limit* due jobs of *queue* for *worker_id*, highest priority first.

    Due jobs are queued jobs with ``run_at <= now()`` and running jobs whose lease
    expired. Each claimed job gets ``status = 'running'``, one more attempt, and a lease
    ending at ``now() + lease``. A job whose lease expired on its last attempt is marked
    failed by the same statement and not returned, so fewer than *limit* jobs may come
    back even when more are due.

    The claim takes effect when the caller commits; keep that transaction short.

    Args:
        exclude_kinds: Kinds not to claim: the limited kinds, which only
            :func:`claim_limited` may claim.
        where: Claim only jobs matching this boolean clause (or every clause of a
            sequence) over :data:`sqlaq.jobs` columns, for worker affinity:
            ``sqlaq.jobs.c.payload["region"].astext == "eu"``. It is applied inside the
            claim's locking subquery, so non-matching jobs are neither claimed nor
            locked (see :func:`sqlaq.queries.claim_stmt`). Pass the same clause object
            on every call: the claim statement built around it is cached by its
            identity (a new clause object costs about a millisecond to build around).

    Raises:
        ConfigError: *limit* is not a positive int, *worker_id* not a UUID, or *where*
            not a clause over ``sqlaq.jobs``.
        InvalidJobError: *lease* is not a positive timedelta of at most 100 years, or
            *queue* is not a name.
    """
    _check_claim(worker_id, queue, limit, lease)
    kinds = _check_kinds(exclude_kinds) if exclude_kinds else []
    if (yield DISTRIBUTED):
        params = citus_queries.citus_claim_params(
            queue=queue, worker_id=worker_id, limit=limit, lease=lease, token=uuid4().hex,
            exclude_kinds=kinds,
        )  # fmt: skip
        if _narrows(where):
            stmt = _narrowed_claim(where, "citus-excluding" if kinds else "citus")
        else:
            stmt = _citus_claim_excluding_stmt() if kinds else _citus_claim_stmt()
        claimed = yield stmt, params
        return _claimed(claimed.all(), worker_id, lease)
    params = queries.claim_params(
        queue=queue, worker_id=worker_id, limit=limit, lease=lease, exclude_kinds=kinds
    )
    if where is not None and not (isinstance(where, Sequence) and not where):
        stmt = _narrowed_claim(where, "excluding" if kinds else "")
    else:
        stmt = _CLAIM_EXCLUDING if kinds else _CLAIM
    claimed = yield stmt, params
    return _claimed(claimed.all(), worker_id, lease)


def claim_bounded(
    *,
    worker_id: UUID,
    queue: str,
    limit: int,
    lease: timedelta,
    after: ClaimPosition | None,
    exclude_kinds: Collection[str] = (),
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
) -> Plan[tuple[list[ClaimedJob], ClaimPosition | None]]:
    """The worker's claim: :func:`claim` starting after the claim index's position
    *after* (None: from the queue's first entry), see :func:`sqlaq.queries.claim_stmt`
    (``bounded``). A plan, run by the worker's fetcher (not an operation of the API).
    On a job table distributed on Citus it is :func:`claim` itself (no position).

    Returns the claimed jobs, and the position of the last job the claim took (its
    ``run_at`` as it was before the claim; a job it marked failed counts), where the
    next claim may start; None when it took none.
    """
    if (yield DISTRIBUTED):  # on Citus, the plain claim's shape: no bound (yet)
        jobs = yield from plan_of(claim)(
            worker_id=worker_id,
            queue=queue,
            limit=limit,
            lease=lease,
            exclude_kinds=exclude_kinds,
            where=where,
        )
        return jobs, None
    _check_claim(worker_id, queue, limit, lease)
    kinds = _check_kinds(exclude_kinds) if exclude_kinds else []
    params = queries.claim_params(
        queue=queue,
        worker_id=worker_id,
        limit=limit,
        lease=lease,
        exclude_kinds=kinds,
        after=FULL_CLAIM if after is None else after,
    )
    if where is not None and not (isinstance(where, Sequence) and not where):
        stmt = _narrowed_claim(where, "bounded-excluding" if kinds else "bounded")
    else:
        stmt = _CLAIM_BOUNDED_EXCLUDING if kinds else _CLAIM_BOUNDED
    rows = (yield stmt, params).all()
    if not rows:
        return [], None
    # The last three columns: the position of the last job claimed, on every row.
    position = ClaimPosition(*rows[0][-3:])
    return _claimed([row[:-3] for row in rows], worker_id, lease), position


def first_due(
    *,
    queue: str,
    exclude_kinds: Collection[str] = (),
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
) -> Plan[ClaimPosition | None]:
    """The claim index's position of the first job a claim of *queue* would take
    (:func:`sqlaq.queries.first_due_stmt`), None when none is due. A plan, run by the
    worker's fetcher when it looks behind its bound (not an operation of the API). On
    a job table distributed on Citus, None: the claims there have no bound."""
    if (yield DISTRIBUTED):
        return None
    kinds = _check_kinds(exclude_kinds) if exclude_kinds else []
    if _narrows(where):
        stmt = _narrowed_claim(where, "first-due-excluding" if kinds else "first-due")
    else:
        stmt = _first_due_excluding_stmt() if kinds else _first_due_stmt()
    row = (yield stmt, queries.first_due_params(queue=queue, exclude_kinds=kinds)).first()
    return None if row is None else ClaimPosition(*row)


def _narrows(where: Any) -> bool:
    return where is not None and not (isinstance(where, Sequence) and not where)


@operation
def claim_fair(
    *,
    worker_id: UUID,
    queue: str = DEFAULT_QUEUE,
    limit: int = 1,
    lease: timedelta = DEFAULT_LEASE,
    weights: Mapping[str, int] | None = None,
    exclude_kinds: Collection[str] = (),
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
) -> Plan[list[ClaimedJob]]:
    """Claim up to *limit* due jobs of *queue* for *worker_id*, shared fairly between
    the jobs' keys: :func:`claim`, but a key with a deep backlog gets its share of the
    claim, not all of it.

    Each key is a share (a job without a key is in none: it takes the slots the keys
    leave, in plain order; give every job of a fair queue a key); a claim
    takes from each share with due jobs about ``limit * weight / total weight`` jobs
    (at least one), its first in claim order (priority, then ``run_at``, then id), and
    keeps the *limit* that rank first within their share per unit of weight (ties: the
    higher priority, then at random, so equal shares take turns from claim to claim).
    When the shares with due jobs give fewer than *limit*, the rest is taken in plain
    claim order: a claim comes back short only when fewer jobs are due. One statement
    (see :func:`sqlaq.queries.fair_claim_stmt`): the shares are found by one index
    probe each (a loose index scan of the fair index), whatever their depth, so it
    suits queues with up to some thousands of keys with pending jobs at once.

    Args:
        weights: A key's weight (a positive int; 1 for the keys not named): a key of
            weight 3 gets three times the share of a key of weight 1 while both have
            due jobs.
        exclude_kinds: Kinds not to claim (the limited kinds), as :func:`claim`'s.
        where: Claim only jobs matching this clause, as :func:`claim`'s.

    Raises:
        ConfigError: *limit* is not a positive int, *worker_id* not a UUID, *weights*
            not a mapping of keys to ints from 1 to 1,000,000, or *where* not a clause
            over ``sqlaq.jobs``.
        InvalidJobError: *lease* is not a positive timedelta of at most 100 years, or
            *queue* is not a name.
    """
    _check_claim(worker_id, queue, limit, lease)
    kinds = _check_kinds(exclude_kinds) if exclude_kinds else []
    checked = dict(Weights().check(weights or {}, "weights"))
    yield from refuse(
        "a fair claim",
        "it walks every key of the queue across the shards in one locking statement; "
        "spread tenants over queues (one shard each) instead",
    )
    params = queries.fair_claim_params(
        queue=queue,
        worker_id=worker_id,
        limit=limit,
        lease=lease,
        exclude_kinds=kinds,
        weights=checked,
    )
    if where is not None and not (isinstance(where, Sequence) and not where):
        stmt = _narrowed_claim(where, "fair-excluding" if kinds else "fair")
    else:
        stmt = _claim_fair_excluding_stmt() if kinds else _claim_fair_stmt()
    claimed = yield stmt, params
    return _claimed(claimed.all(), worker_id, lease)


# Narrowed claims, by the identity of their clause(s) and their variant ("": plain,
# "excluding": excluding kinds, "kind": one kind's, "keyed"/"ordered": a keyed kind's
# candidates; "citus", "citus-excluding", "citus-kind", "citus-ordered": the same on a
# job table distributed on Citus; "bounded", "bounded-excluding": the worker's bounded
# claims). Each entry keeps its
# clauses alive, so an id cannot be reused while it is cached.
_NARROWED: dict[tuple[tuple[int, ...], str], tuple[tuple[object, ...], Any]] = {}

_NARROWED_MAX = 64

_NARROWED_LOCK = threading.Lock()


def _narrowed_claim(where: Any, variant: str) -> Any:
    """The claim (or, for the variants "keyed" and "ordered", the keyed candidates'
    select) narrowed by *where*, cached by the clauses' identity."""
    clauses = tuple(where) if isinstance(where, Sequence) else (where,)
    key = (tuple(map(id, clauses)), variant)
    cached = _NARROWED.get(key)
    if cached is not None and all(a is b for a, b in zip(cached[0], clauses, strict=True)):
        return cached[1]
    stmt: Any
    if variant in ("citus", "citus-excluding", "citus-kind"):  # distributed on Citus
        stmt = citus_queries.citus_claim_stmt(
            kind=variant == "citus-kind",
            exclude_kinds=variant == "citus-excluding",
            where=list(clauses),
        )
    elif variant in ("keyed", "ordered", "citus-ordered"):
        stmt = queries.keyed_candidates_stmt(
            ordered=variant != "keyed", where=list(clauses), per_queue=variant == "citus-ordered"
        )
    elif variant in ("first-due", "first-due-excluding"):
        stmt = queries.first_due_stmt(
            queue="_", exclude_kinds=["_"] if variant != "first-due" else (), where=list(clauses)
        )
    elif variant in ("fair", "fair-excluding"):
        stmt = queries.fair_claim_stmt(exclude_kinds=variant != "fair", where=list(clauses))
    else:
        stmt = queries.claim_stmt(
            queue="_",
            worker_id=_NIL,
            limit=1,
            lease=DEFAULT_LEASE,
            kind="_" if variant == "kind" else None,
            exclude_kinds=["_"] if variant in ("excluding", "bounded-excluding") else (),
            where=list(clauses),
            bounded=variant in ("bounded", "bounded-excluding"),
        )
    with _NARROWED_LOCK:  # worker threads claim at once
        if len(_NARROWED) >= _NARROWED_MAX:
            _NARROWED.pop(next(iter(_NARROWED)))  # the oldest entry
        _NARROWED[key] = (clauses, stmt)
    return stmt


@operation
def claim_limited(
    *,
    worker_id: UUID,
    kind: str,
    queue: str = DEFAULT_QUEUE,
    limit: int = 1,
    lease: timedelta = DEFAULT_LEASE,
    concurrency: int | None = None,
    rate: Rate | str | None = None,
    where: ColumnElement[bool] | Sequence[ColumnElement[bool]] = (),
    key_concurrency: int | None = None,
    ordered: bool = False,
) -> Plan[LimitedClaim]:
    """Claim due jobs of one *kind* of *queue* within the kind's global limits.

    At most *concurrency* jobs of *kind* hold a live lease at once, and at most
    ``rate.count`` start in any window of ``rate.period``, whatever the number of
    workers: the claim takes the kind's advisory lock, reads its live leases and its
    start log, claims what the limits allow (up to *limit*), and logs the new starts
    (see :mod:`sqlaq.limits`). Jobs held back stay queued and keep their attempts.

    Per key (the job's ``key``, set at enqueue): with *key_concurrency*, at most that
    many jobs of one key of *kind* hold a live lease at once; with *ordered* (strict
    order per key), the jobs of one key run one at a time, in enqueue order (by id),
    and a job waits while an earlier job of its key is queued (due or not: one waiting
    for its retry holds the line), running, or failed: a job that failed for good holds
    its key until it is retried (it then runs again, first) or deleted. Jobs without a
    key are limited by the kind's limits only. Under the same lock, the claim reads the
    live leases per key (the running index: running rows only), picks the due jobs in
    claim order that their keys allow (a few rows at a time, leaving out full keys),
    and claims those by id.

    It must run in a transaction (not in autocommit): the lock is held until the caller
    commits, and the next claim of the kind waits for it. Commit at once.

    *where* narrows the claim as :func:`claim`'s does: only the kind's jobs matching it
    are claimed (and locked). The limits stay the kind's, counted over all its jobs:
    a job of the kind running elsewhere, matching or not, holds one of its slots.

    Raises:
        ConfigError: *limit*, *concurrency* or *key_concurrency* is not a positive int,
            *ordered* with a *key_concurrency* other than 1, *rate* is not a rate, or
            *where* not a clause over ``sqlaq.jobs``.
        InvalidJobError: *lease* is not a positive timedelta of at most 100 years, or
            *queue* or *kind* is not a name.
    """
    _check_claim(worker_id, queue, limit, lease)
    check_name("kind", kind)
    if (yield AUTOCOMMIT):
        raise ConfigError(
            "claim_limited needs a transaction (its lock lasts until commit); "
            "this connection is in autocommit"
        )
    if concurrency is not None:
        _check_positive("concurrency", concurrency)
    if key_concurrency is not None:
        _check_positive("key_concurrency", key_concurrency)
    if ordered:
        if key_concurrency not in (None, 1):
            raise ConfigError(
                f"ordered runs one job of a key at a time: key_concurrency must be 1 or None, "
                f"got {shown(key_concurrency)}"
            )
        key_concurrency = 1
    if isinstance(rate, str):
        rate = Rate.parse(rate)
    citus = yield DISTRIBUTED
    narrowed = _narrows(where)
    if narrowed:
        stmt = _narrowed_claim(where, "citus-kind" if citus else "kind")
    else:
        stmt = _citus_claim_kind_stmt() if citus else _claim_kind_stmt()
    yield _lock_kind_stmt(), {"b_kind": kind}
    state = yield _kind_state_stmt(), queries.kind_limit_state_params(kind=kind, rate=rate)
    running, recent, pivot, now = state.one()
    allowed = allowance(
        limit,
        concurrency=concurrency,
        running=running,
        rate=rate,
        recent=recent if rate is not None else 0,
        pivot=pivot,
        now=now,
    )
    jobs: list[ClaimedJob] = []
    keys_full = False
    if allowed.count and key_concurrency is not None:
        variant = ("citus-ordered" if citus else "ordered") if ordered else "keyed"
        if narrowed:
            select_ = _narrowed_claim(where, variant)
        elif ordered:
            select_ = _citus_ordered_candidates_stmt() if citus else _ordered_candidates_stmt()
        else:
            select_ = _keyed_candidates_stmt()
        picked, keys_full = yield from _pick_keyed(
            select_, kind=kind, queue=queue, wanted=allowed.count, cap=key_concurrency
        )
        if picked and citus:
            params = citus_queries.citus_claim_params(
                queue=queue, worker_id=worker_id, limit=len(picked), lease=lease,
                token=uuid4().hex, kind=kind, ids=picked,
            )  # fmt: skip
            jobs = _claimed((yield _citus_claim_ids_stmt(), params).all(), worker_id, lease)
        elif picked:
            params = queries.claim_params(
                queue=queue,
                worker_id=worker_id,
                limit=len(picked),
                lease=lease,
                kind=kind,
                ids=picked,
            )
            jobs = _claimed((yield _claim_ids_stmt(), params).all(), worker_id, lease)
    elif allowed.count:
        if citus:
            params = citus_queries.citus_claim_params(
                queue=queue, worker_id=worker_id, limit=allowed.count, lease=lease,
                token=uuid4().hex, kind=kind,
            )  # fmt: skip
        else:
            params = queries.claim_params(
                queue=queue, worker_id=worker_id, limit=allowed.count, lease=lease, kind=kind
            )
        claimed_rows = yield stmt, params
        jobs = _claimed(claimed_rows.all(), worker_id, lease)
    if rate is not None and jobs:
        yield (
            _record_starts_stmt(),
            queries.record_starts_params(kind=kind, rate=rate, started=len(jobs)),
        )
    if len(jobs) < allowed.count:
        # Nothing more is due, or the due jobs' keys are at their limit: a job of the
        # kind that ends (or the next poll) may free one.
        return LimitedClaim(jobs, keys_full)
    return LimitedClaim(jobs, allowed.full, allowed.rate_wait)


def _pick_keyed(
    select_: Any, *, kind: str, queue: str, wanted: int, cap: int
) -> Plan[tuple[list[int], bool]]:
    """The ids of up to *wanted* due jobs of a keyed *kind* that their keys allow (at
    most *cap* live leases per key), in claim order; and whether a key was at its cap.

    Run under the kind's lock. Each round asks for as many candidates as are still
    wanted, leaving out the keys already full and the jobs picked; a round that takes
    fewer than it read filled a key, so the next one leaves that key out: at most one
    round per key filled, plus one.
    """
    rows = yield _key_running_stmt(), {"b_kind": kind}
    room = {key: cap - running for key, running in rows.all()}
    full = sorted(key for key, left in room.items() if left <= 0)
    picked: list[int] = []
    while len(picked) < wanted:
        asked = wanted - len(picked)
        params = queries.keyed_candidates_params(
            queue=queue, kind=kind, limit=asked, full_keys=full, picked=picked
        )
        candidates = (yield select_, params).all()
        for job_id, key in candidates:
            if key is None:
                picked.append(job_id)
                continue
            left = room.get(key, cap)
            if left <= 0:
                continue  # filled by this round
            picked.append(job_id)
            room[key] = left - 1
            if left == 1:
                full.append(key)
        if len(candidates) < asked:
            break  # nothing more is due
    return picked, bool(full)


def _check_claim(worker_id: UUID, queue: str, limit: int, lease: timedelta) -> None:
    if not isinstance(worker_id, UUID):
        raise ConfigError(f"worker_id must be a uuid.UUID, got {type(worker_id).__name__}")
    _check_positive("limit", limit)
    check_duration("lease", lease, allow_zero=False)
    check_name("queue", queue)


def _check_kinds(kinds: Collection[str]) -> list[str]:
    if isinstance(kinds, str):
        raise InvalidJobError(f"kinds must be a collection of names, not a str: {shown(kinds)}")
    for kind in kinds:
        check_name("kind", kind)
    return sorted(kinds)


def _claimed(rows: Sequence[Any], worker_id: UUID, lease: timedelta) -> list[ClaimedJob]:
    """Claimed rows (in queries.CLAIM_COLUMNS order) as ClaimedJobs, in claim order.

    A row the claim marked failed (its lease expired on the last attempt) is left out.
    ``attempted_at`` is not read back: the claim wrote ``run_at = now() + lease`` and
    ``attempted_at = now()``, so it is ``run_at - lease``, exactly (a subtraction costs
    less than decoding one more timestamp per row).
    """
    # Positional unpacking: attribute access by name on Row costs several times more,
    # and a worker claims thousands of rows a second; the dataclasses are built without
    # their __init__ (encoding.slot_setters), half the cost.
    new_job, new_lease = _new_claimed_job, _new_lease
    claimed = [
        new_job(
            job_id,
            queue_,
            kind,
            payload,
            priority,
            attempts,
            max_attempts,
            created_at,
            new_lease(job_id, worker_id, token, attempts, run_at, queue_),
            run_at - lease,
            headers,
            timeout,
            key,
        )
        for (
            job_id,
            queue_,
            kind,
            payload,
            priority,
            status,
            attempts,
            max_attempts,
            token,
            run_at,
            created_at,
            headers,
            timeout,
            key,
        ) in rows
        if status == "running"
    ]
    # UPDATE ... RETURNING has no order; hand jobs out in claim order as far as known:
    # by id, then (stable) by priority, highest first; two sorts by a key in C cost a
    # third of one by a key made in Python.
    claimed.sort(key=_BY_ID)
    claimed.sort(key=_BY_PRIORITY, reverse=True)
    return claimed


_BY_ID = operator.attrgetter("id")

_BY_PRIORITY = operator.attrgetter("priority")

_CLAIMED_SETTERS = slot_setters(ClaimedJob)

_LEASE_SETTERS = slot_setters(Lease)


def _new_lease(
    job_id: int,
    worker_id: UUID,
    token: UUID,
    attempt: int,
    expires: Any,
    queue: str | None = None,
) -> Lease:
    """``Lease(...)``, faster (see :func:`~sqlaq.encoding.slot_setters`)."""
    set_id, set_worker, set_token, set_attempt, set_expires, set_queue = _LEASE_SETTERS
    lease = object.__new__(Lease)
    set_id(lease, job_id)
    set_worker(lease, worker_id)
    set_token(lease, token)
    set_attempt(lease, attempt)
    set_expires(lease, expires)
    set_queue(lease, queue)
    return lease


def _new_claimed_job(
    job_id: int,
    queue: str,
    kind: str,
    payload: dict[str, Any],
    priority: int,
    attempt: int,
    max_attempts: int,
    created_at: datetime,
    lease: Lease,
    attempted_at: datetime | None,
    headers: dict[str, Any] | None,
    timeout: timedelta | None,
    key: str | None,
) -> ClaimedJob:
    """``ClaimedJob(...)`` with every field given, faster (see
    :func:`~sqlaq.encoding.slot_setters`)."""
    (
        set_id,
        set_queue,
        set_kind,
        set_payload,
        set_priority,
        set_attempt,
        set_max_attempts,
        set_created_at,
        set_lease,
        set_attempted_at,
        set_headers,
        set_timeout,
        set_key,
    ) = _CLAIMED_SETTERS
    job = object.__new__(ClaimedJob)
    set_id(job, job_id)
    set_queue(job, queue)
    set_kind(job, kind)
    set_payload(job, payload)
    set_priority(job, priority)
    set_attempt(job, attempt)
    set_max_attempts(job, max_attempts)
    set_created_at(job, created_at)
    set_lease(job, lease)
    set_attempted_at(job, attempted_at)
    set_headers(job, headers)
    set_timeout(job, timeout)
    set_key(job, key)
    return job
