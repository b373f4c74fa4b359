"""The worker runtime: :class:`Worker` and its parts (one module per concurrent
responsibility; see :mod:`sqlaq.worker.core` for the map)."""

from __future__ import annotations

from sqlaq.worker.core import (
    FINAL_WRITE_SECONDS,
    LISTENER_APPLICATION_NAME,
    WORKER_APPLICATION_NAME,
    Worker,
)
from sqlaq.worker.run import JobResult

__all__ = [
    "FINAL_WRITE_SECONDS",
    "LISTENER_APPLICATION_NAME",
    "WORKER_APPLICATION_NAME",
    "JobResult",
    "Worker",
]
