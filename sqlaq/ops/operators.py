"""Operators: wake the workers of queues (NOTIFY on commit)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlaq import queries
from sqlaq.drive import Plan, operation


@operation
def notify_queues(queues: Sequence[str]) -> Plan[None]:
    """Wake the workers of *queues* when the caller commits (NOTIFY ``sqlaq_jobs``)."""
    if queues:
        (yield queries.notify_queues_stmt(queues=queues), None).all()
