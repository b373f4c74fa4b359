"""Operators' controls: pausing a queue, and the workers' heartbeat rows.

This module owns the operations over the tables of revision ``sqlaq_0004`` that
operators use (the ``sqlaq pause``, ``resume`` and ``workers`` commands call them):

* :func:`pause` and :func:`resume` write ``sqlaq_paused_queues``. The pause lives in
  the database, not in any worker: every claim looks its queue up there (see
  :func:`sqlaq.queries.claim_stmt`), so once the pause commits no worker claims a job of
  the queue, whatever its version of the registry and however many there are. Jobs
  already running finish as usual; enqueueing into a paused queue still works (the
  jobs wait). A resume notifies the queue's workers, so idle ones claim at once rather
  than at their next poll.
* :func:`list_workers` reads ``sqlaq_workers``, where each worker's maintenance thread
  keeps a row up to date (:mod:`sqlaq.maintenance`).

Like :mod:`sqlaq.ops`, every function runs on the caller's Connection or Session and
never commits: a pause takes effect when the caller commits. Each is an operation of
:mod:`sqlaq.ops.operators` (with its ``await``-able twin in :mod:`sqlaq.asyncio`), and
its records live in :mod:`sqlaq.records`; this module keeps their names importable.
"""

from __future__ import annotations

from sqlaq.ops.operators import list_workers, pause, paused_queues, resume
from sqlaq.records import PausedQueue, WorkerInfo

__all__ = ["PausedQueue", "WorkerInfo", "list_workers", "pause", "paused_queues", "resume"]
