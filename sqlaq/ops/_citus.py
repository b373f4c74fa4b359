"""Citus at run time: whether the job table is distributed (read from Citus's catalog
once per engine), and the refusal of what does not run on it yet. Private to
:mod:`sqlaq.ops`; :mod:`sqlaq.citus` is the public side.
"""

from __future__ import annotations

from collections.abc import Iterable
from weakref import WeakKeyDictionary

from sqlaq.drive import PerEngine, Plan
from sqlaq.errors import ConfigError
from sqlaq.lease import Lease
from sqlaq.queries import citus as citus_queries


def _detect() -> Plan[bool]:
    """Whether ``sqlaq_jobs`` is a distributed table of Citus here: the extension is
    installed and ``pg_dist_partition`` holds the table (two catalog reads)."""
    if (yield citus_queries.citus_version_stmt(), None).first() is None:
        return False
    return (yield citus_queries.citus_distribution_stmt(), None).first() is not None


#: Step: whether the job table is distributed on Citus, read once per engine (see
#: :class:`sqlaq.drive.PerEngine`). Operations yield it to choose their statements.
DISTRIBUTED = PerEngine(_detect, WeakKeyDictionary())


def refuse(operation: str, why: str) -> Plan[None]:
    """Raise :class:`~sqlaq.errors.ConfigError` if the job table is distributed on Citus:
    *operation* does not run there yet, for the reason *why* (one line, no traceback of
    Citus's)."""
    if (yield DISTRIBUTED):
        raise ConfigError(
            f"{operation} is not supported on Citus (sqlaq_jobs is distributed): {why}"
        )


def by_queue(leases: Iterable[Lease], operation: str) -> dict[str, list[Lease]]:
    """*leases* grouped by their job's queue, in first-seen order: on Citus a fenced
    update runs per queue (a router statement on the queue's shard)."""
    groups: dict[str, list[Lease]] = {}
    for lease in leases:
        if lease.queue is None:
            raise ConfigError(
                f"{operation} on Citus needs each lease's queue (sqlaq_jobs is distributed by "
                f"queue): the lease of job {lease.job_id} has none; use the Lease a claim "
                "returned"
            )
        groups.setdefault(lease.queue, []).append(lease)
    return groups
