"""Prometheus metrics of a worker (the optional ``sqlaq[prometheus]`` extra).

Series:

* ``sqlaq_jobs_started_total{queue,kind}``: jobs this process started;
* ``sqlaq_jobs_finished_total{queue,kind,outcome}``: outcome is ``done``, ``retried``,
  ``snoozed``, ``failed`` or ``lost`` (the lease was lost and nothing was written);
* ``sqlaq_job_duration_seconds{queue,kind}``: how long handlers ran (histogram);
* ``sqlaq_queue_depth{queue}``: jobs due now and not running, read from the database at
  scrape time (one grouped query per scrape, never on the worker's hot path);
* ``sqlaq_key_running{key}`` and ``sqlaq_key_queued{key}``: running and queued jobs of
  the busiest job keys, read at scrape time like the depth. Only the
  :data:`~sqlaq.queries.BUSIEST_KEYS` (20) busiest keys are exported, so the series stay
  bounded however many tenants there are: a key leaves the export when others are
  busier (its series then ends).

This module observes the worker through its callbacks; it runs no job. It imports
``prometheus_client`` when a :class:`WorkerMetrics` is made, so sqlaq itself does not
depend on it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine

from sqlaq import queries
from sqlaq.errors import ConfigError
from sqlaq.outcome import Verdict

if TYPE_CHECKING:
    from sqlaq.ops import ClaimedJob
    from sqlaq.worker import JobResult

_log = logging.getLogger(__name__)

#: The ``outcome`` label of each verdict (names kept from before verdicts existed).
_OUTCOMES = {verdict: verdict.value for verdict in Verdict} | {Verdict.RETRY: "retried"}


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core  # GaugeMetricFamily lives here
    except ImportError:
        raise ConfigError(
            "metrics need prometheus_client: pip install 'sqlaq[prometheus]'"
        ) from None
    return prometheus_client


class WorkerMetrics:
    """Counters and histograms fed by a worker's callbacks, and a queue-depth collector.

    Args:
        engine: The queue's database, read at scrape time for the queue depth.
        registry: A ``prometheus_client.CollectorRegistry``; default a new one, so two
            workers in one process (tests) never collide in the global registry.

    Raises:
        ConfigError: ``prometheus_client`` is not installed.
    """

    def __init__(self, engine: Engine, registry: Any = None) -> None:
        prom = _prometheus()
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self.started = prom.Counter(
            "sqlaq_jobs_started", "Jobs started.", ["queue", "kind"], registry=self.registry
        )
        self.finished = prom.Counter(
            "sqlaq_jobs_finished",
            "Jobs finished, by outcome.",
            ["queue", "kind", "outcome"],
            registry=self.registry,
        )
        self.duration = prom.Histogram(
            "sqlaq_job_duration_seconds",
            "Time handlers ran.",
            ["queue", "kind"],
            registry=self.registry,
        )
        self.registry.register(_QueueDepth(engine, prom))
        self.registry.register(_BusiestKeys(engine, prom))
        self._server: Any = None

    def job_started(self, job: ClaimedJob) -> None:
        """Count *job* started (a worker's ``on_job_started``)."""
        self.started.labels(job.queue, job.kind).inc()

    def job_finished(self, result: JobResult) -> None:
        """Count *result* and observe its duration (a worker's ``on_job_finished``)."""
        verdict = result.outcome.verdict if result.outcome is not None else Verdict.LOST
        outcome = _OUTCOMES[verdict]
        self.finished.labels(result.queue, result.kind, outcome).inc()
        self.duration.labels(result.queue, result.kind).observe(result.duration)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:  # noqa: S104 - a scrape target
        """Serve ``/metrics`` on *port* from a daemon thread."""
        prom = _prometheus()
        self._server, _ = prom.start_http_server(port, addr=addr, registry=self.registry)

    def close(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server = None


class _QueueDepth:
    """Collects ``sqlaq_queue_depth`` from the database at scrape time."""

    def __init__(self, engine: Engine, prom: Any) -> None:
        self._engine = engine
        self._prom = prom

    def collect(self) -> Iterator[Any]:
        gauge = self._prom.core.GaugeMetricFamily(
            "sqlaq_queue_depth", "Jobs due and waiting, by queue.", labels=["queue"]
        )
        try:
            with self._engine.connect() as conn:
                for row in conn.execute(queries.stats_health_stmt()):
                    gauge.add_metric([row.queue], row.due)
        except Exception:  # a scrape must not fail because the database is away
            _log.warning("could not read the queue depth", exc_info=True)
        yield gauge

    def describe(self) -> Iterator[Any]:
        # Described without data, so registering does not query the database.
        yield self._prom.core.GaugeMetricFamily(
            "sqlaq_queue_depth", "Jobs due and waiting, by queue.", labels=["queue"]
        )


class _BusiestKeys:
    """Collects ``sqlaq_key_running`` and ``sqlaq_key_queued`` of the busiest keys
    (:func:`sqlaq.queries.busiest_keys_stmt`: at most ``BUSIEST_KEYS`` series each) from
    the database at scrape time."""

    def __init__(self, engine: Engine, prom: Any) -> None:
        self._engine = engine
        self._prom = prom

    def _families(self) -> tuple[Any, Any]:
        family = self._prom.core.GaugeMetricFamily
        return (
            family("sqlaq_key_running", "Running jobs of the busiest keys.", labels=["key"]),
            family("sqlaq_key_queued", "Queued jobs of the busiest keys.", labels=["key"]),
        )

    def collect(self) -> Iterator[Any]:
        running, queued = self._families()
        try:
            with self._engine.connect() as conn:
                for row in conn.execute(queries.busiest_keys_stmt()):
                    running.add_metric([row.key], row.running)
                    queued.add_metric([row.key], row.queued)
        except Exception:  # a scrape must not fail because the database is away
            _log.warning("could not read the busiest keys", exc_info=True)
        yield running
        yield queued

    def describe(self) -> Iterator[Any]:
        # Described without data, so registering does not query the database.
        yield from self._families()
