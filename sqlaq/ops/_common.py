"""Shared pieces of the operations: defaults, input checks, and the lease bookkeeping
of fenced operations. Private to :mod:`sqlaq.ops`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import datetime, timedelta
from functools import cache, partial
from typing import Any, TypeVar
from uuid import UUID

from sqlaq.bounds import BIGINT_MAX, BIGINT_MIN, INT4_MAX
from sqlaq.errors import ConfigError, LeaseLostError, shown
from sqlaq.lease import Lease

#: How long a claim holds its jobs unless told otherwise: 30 seconds.
DEFAULT_LEASE = timedelta(seconds=30)

#: The default *limit* of :func:`prune` and :func:`sweep`: jobs handled per call.
DEFAULT_PRUNE_BATCH = 1000


_NIL = UUID(int=0)

_NIL_LEASE = Lease(0, _NIL, _NIL, 0, datetime.min)

S = TypeVar("S")


def on_first_use(builder: Callable[..., S], /, *args: Any, **kwargs: Any) -> Callable[[], S]:
    """The statement ``builder(*args, **kwargs)``, built at the first call of the
    accessor returned and the same object at every call after (one cached call: about
    50 ns, against the microseconds of running it).

    For the statements of paths a plain worker never takes (Citus, fair and limited
    claims, debounce, ``unique_for``): built at import, each would cost memory in every
    process (tens of KiB for a claim). The plain paths' statements (claim, bounded claim,
    enqueue, settle) are module constants, built at import. Two threads calling an
    accessor first at once may each build one: equal statements (SQLAlchemy caches their
    compiled form by structure), so it does not matter which the accessor keeps.
    """
    return cache(partial(builder, *args, **kwargs))


def _check_positive(name: str, value: object) -> None:
    # Bound to PostgreSQL's integer: a larger one fails in the database, not here.
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT4_MAX:
        raise ConfigError(f"{name} must be a positive int (up to {INT4_MAX}), got {shown(value)}")


def _as_leases(leases: Lease | Iterable[Lease]) -> list[Lease]:
    return [leases] if isinstance(leases, Lease) else list(leases)


def _check_lost(requested: Sequence[Lease], changed: Collection[int], raise_on_lost: bool) -> None:
    if raise_on_lost:
        lost = [lease.job_id for lease in requested if lease.job_id not in changed]
        if lost:
            raise LeaseLostError(lost)


def check_job_id(value: object) -> None:
    """Refuse what is not a job id: an int (not a bool) within PostgreSQL's bigint."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"a job id must be an int, got {shown(value)}")
    if not BIGINT_MIN <= value <= BIGINT_MAX:
        raise ConfigError(f"job ids are bigints; {shown(value)} is out of range")


def _ids(job_ids: int | Iterable[int]) -> list[int]:
    ids = [job_ids] if isinstance(job_ids, int) else list(job_ids)
    for value in ids:
        check_job_id(value)
    return ids
