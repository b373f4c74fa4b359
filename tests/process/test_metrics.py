"""Prometheus metrics: the series a worker exposes, in process and on sqlaq-worker."""

from __future__ import annotations

import signal
import socket
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from sqlalchemy import Engine
from workerkit import START_TIMEOUT, wait_until, worker_processes

import sqlaq
from sqlaq.metrics import _OUTCOMES, WorkerMetrics

pytestmark = pytest.mark.timeout(60)


def test_worker_metrics_count_starts_outcomes_durations_and_queue_depth(
    committed: Engine,
) -> None:
    registry = sqlaq.Registry()

    @registry.handler("ok")
    def ok(payload: dict[str, Any]) -> None:
        pass

    @registry.handler("boom")
    def boom(payload: dict[str, Any]) -> None:
        raise RuntimeError("boom")

    with committed.begin() as conn:
        for _ in range(3):
            sqlaq.enqueue(conn, "ok")
        sqlaq.enqueue(conn, "boom", max_attempts=1)
        sqlaq.enqueue(conn, "boom", queue="elsewhere", max_attempts=2)
    metrics = WorkerMetrics(committed)
    worker = sqlaq.Worker(
        committed,
        registry,
        burst=True,
        on_job_started=metrics.job_started,
        on_job_finished=metrics.job_finished,
    )
    worker.run()
    with committed.begin() as conn:
        sqlaq.enqueue(conn, "ok")
        sqlaq.enqueue(conn, "ok", queue="elsewhere")

    text = generate_latest(metrics.registry).decode()
    assert 'sqlaq_jobs_started_total{kind="ok",queue="default"} 3.0' in text
    assert 'sqlaq_jobs_started_total{kind="boom",queue="default"} 1.0' in text
    assert 'sqlaq_jobs_finished_total{kind="ok",outcome="done",queue="default"} 3.0' in text
    assert 'sqlaq_jobs_finished_total{kind="boom",outcome="failed",queue="default"} 1.0' in text
    assert 'sqlaq_job_duration_seconds_count{kind="ok",queue="default"} 3.0' in text
    # The worker served only "default"; the depth is read from the table at scrape time.
    assert 'sqlaq_queue_depth{queue="default"} 1.0' in text
    assert 'sqlaq_queue_depth{queue="elsewhere"} 2.0' in text


def test_worker_metrics_export_the_busiest_keys_only(committed: Engine) -> None:
    from sqlaq.queries import BUSIEST_KEYS

    with committed.begin() as conn:
        sqlaq.enqueue_many(conn, [sqlaq.NewJob("k", key="acme") for _ in range(50)])
        for n in range(BUSIEST_KEYS + 5):  # more keys than are exported, 2 jobs each
            sqlaq.enqueue_many(conn, [sqlaq.NewJob("k", key=f"t{n:02d}") for _ in range(2)])
        sqlaq.enqueue(conn, "k", key="busy")
        sqlaq.enqueue(conn, "k")  # no key: in no key's series
    with committed.begin() as conn:
        jobs = sqlaq.claim(conn, worker_id=uuid.uuid4(), limit=200)
        busy = [job for job in jobs if job.key == "busy"]
        for job in jobs:
            if job.key != "busy":
                sqlaq.handback(conn, [job.lease])
    assert len(busy) == 1
    text = generate_latest(WorkerMetrics(committed).registry).decode()
    assert 'sqlaq_key_running{key="busy"} 1.0' in text
    assert 'sqlaq_key_queued{key="busy"} 0.0' in text
    assert 'sqlaq_key_queued{key="acme"} 50.0' in text
    assert text.count("sqlaq_key_queued{") == BUSIEST_KEYS
    assert text.count("sqlaq_key_running{") == BUSIEST_KEYS


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return ""


@pytest.mark.timeout(120)
def test_sqlaq_worker_serves_metrics_on_its_port(committed: Engine, database_url: str) -> None:
    port = _free_port()
    with worker_processes(database_url) as start:
        worker = start("--metrics-port", str(port))
        # The endpoint opens after the process's start-up (imports), not what is tested.
        wait_until(lambda: _scrape(port), START_TIMEOUT, "the metrics endpoint")
        with committed.begin() as conn:
            sqlaq.enqueue(conn, "noop")
        finished = 'sqlaq_jobs_finished_total{kind="noop",outcome="done",queue="default"} 1.0'
        wait_until(lambda: finished in _scrape(port), 20, "the finished counter")
        worker.signal(signal.SIGTERM)
        assert worker.wait(20) == 0


def test_the_metrics_page_names_every_series_and_outcome(committed: Engine) -> None:
    page = (Path(__file__).parents[2] / "docs" / "how-to" / "tracing-and-metrics.md").read_text()
    families = [family.name for family in WorkerMetrics(committed).registry.collect()]
    assert {"sqlaq_jobs_started", "sqlaq_key_queued", "sqlaq_queue_depth"} <= set(families)
    assert [name for name in families if f"`{name}" not in page] == []
    assert [o for o in _OUTCOMES.values() if f"`{o}`" not in page] == []
