"""Tracing (``sqlaq[otel]``): the enqueue's trace context stored with the job, a span per
attempt in the worker, linked to it. Spans go to OpenTelemetry's in-memory exporter."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import tenacity
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import Connection, Engine, text
from workerkit import wait_until

import sqlaq
from sqlaq import queries, tracing

pytestmark = pytest.mark.timeout(60)

_EXPORTER = InMemorySpanExporter()


class _WhileTesting(SimpleSpanProcessor):
    """Exports only while a test of this module runs: the global provider outlives it,
    and the rest of the suite's in-process workers must not fill the exporter."""

    active = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.active:
            super().on_end(span)


_PROCESSOR = _WhileTesting(_EXPORTER)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The in-memory exporter behind the global tracer provider (set once per process:
    OpenTelemetry refuses a second one), emptied around the test."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(_PROCESSOR)
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    _PROCESSOR.active = True
    try:
        yield _EXPORTER
    finally:
        _PROCESSOR.active = False
        _EXPORTER.clear()


def _request_span() -> Any:
    return trace.get_tracer("tests").start_as_current_span("POST /orders")


def _processed(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    found = [s for s in exporter.get_finished_spans() if s.name.startswith("process ")]
    return sorted(found, key=lambda s: (s.attributes or {}).get("sqlaq.job.attempt", 0))


def test_the_extra_is_installed_here() -> None:
    assert tracing.ENABLED


def test_capture_gives_the_current_trace_context_or_none(spans: InMemorySpanExporter) -> None:
    assert tracing.capture() is None  # no span, nothing to store
    with _request_span() as span:
        captured = tracing.capture()
    assert captured is not None
    traceparent = json.loads(captured)["traceparent"]
    assert traceparent.split("-")[1] == f"{span.get_span_context().trace_id:032x}"


def test_the_enqueue_statements_store_it_with_the_job(
    conn: Connection, spans: InMemorySpanExporter
) -> None:
    with _request_span() as span:
        headers = tracing.capture()
        one = conn.execute(queries.enqueue_stmt(job=sqlaq.NewJob("k"), headers=headers))
        many = conn.execute(
            queries.enqueue_many_stmt(jobs_=[sqlaq.NewJob("k"), sqlaq.NewJob("k")], headers=headers)
        )
    ids = [one.scalar_one(), *(row.id for row in many)]
    stored = conn.execute(
        text("SELECT headers FROM sqlaq_jobs WHERE id = ANY(:ids)"), {"ids": ids}
    ).scalars()
    trace_id = f"{span.get_span_context().trace_id:032x}"
    assert [h["traceparent"].split("-")[1] for h in stored] == [trace_id] * 3
    # Without headers, as every enqueue without a trace: NULL.
    plain = sqlaq.enqueue(conn, "k").job_id
    assert (
        conn.execute(text("SELECT headers FROM sqlaq_jobs WHERE id = :i"), {"i": plain}).scalar()
        is None
    )


def test_an_attempt_span_is_linked_to_the_stored_trace_context(
    conn: Connection, spans: InMemorySpanExporter
) -> None:
    with _request_span() as request:
        stmt = queries.enqueue_stmt(
            job=sqlaq.NewJob("ship", queue="orders"), headers=tracing.capture()
        )
        job_id = conn.execute(stmt).scalar_one()
    headers = conn.execute(
        text("SELECT headers FROM sqlaq_jobs WHERE id = :i"), {"i": job_id}
    ).scalar()

    attempt = tracing.start(job_id=job_id, kind="ship", queue="orders", attempt=1, headers=headers)
    assert attempt is not None
    assert trace.get_current_span() is attempt.span  # current while the handler runs
    tracing.end(attempt, None)
    assert trace.get_current_span() is not attempt.span

    (span,) = _processed(spans)
    (link,) = span.links
    assert link.context.trace_id == request.get_span_context().trace_id
    assert link.context.span_id == request.get_span_context().span_id
    assert span.context.trace_id != request.get_span_context().trace_id  # a trace of its own
    assert span.name == "process orders"


def test_links_ignore_headers_without_a_trace_context() -> None:
    assert tracing.links(None) == []
    assert tracing.links({}) == []
    assert tracing.links("not json") == []
    assert tracing.links({"traceparent": "garbage"}) == []


def test_a_worker_runs_each_attempt_in_a_span_of_its_own(
    committed: Engine, spans: InMemorySpanExporter
) -> None:
    """A job that fails once and then succeeds: two spans, each with the job's id, kind,
    queue, attempt and outcome, the failed one marked as an error; the handler's own span
    is a child of its attempt's. An async handler's attempt gets its span too."""
    registry = sqlaq.Registry()
    tracer = trace.get_tracer("tests")

    @registry.handler("flaky", wait=tenacity.wait_fixed(0))
    def flaky(payload: dict[str, Any]) -> None:
        with tracer.start_as_current_span("charge card"):
            if sqlaq.current_job().attempt == 1:
                raise ConnectionError("card service down")

    @registry.handler("notify")
    async def notify(payload: dict[str, Any]) -> None:
        pass

    with committed.begin() as conn:
        flaky_id = sqlaq.enqueue(conn, "flaky").job_id
        notify_id = sqlaq.enqueue(conn, "notify", queue="mail").job_id
    results: list[sqlaq.JobResult] = []
    worker = sqlaq.Worker(
        committed,
        registry,
        queues=["default", "mail"],
        concurrency=2,
        maintenance=False,
        poll_interval=timedelta(milliseconds=100),
        on_job_finished=results.append,
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: len(results) == 3, 30, "three attempts written")
    finally:
        worker.stop()
        thread.join(10)

    by_job = {}
    for span in _processed(spans):
        attributes = dict(span.attributes or {})
        by_job.setdefault(attributes["messaging.message.id"], []).append((span, attributes))
    first, second = by_job[str(flaky_id)]
    assert first[1] == {
        "messaging.system": "sqlaq",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "default",
        "messaging.message.id": str(flaky_id),
        "sqlaq.job.kind": "flaky",
        "sqlaq.job.attempt": 1,
        "sqlaq.job.outcome": "retry",
    }
    assert (second[1]["sqlaq.job.attempt"], second[1]["sqlaq.job.outcome"]) == (2, "done")
    assert first[0].kind is SpanKind.CONSUMER
    assert first[0].status.status_code is StatusCode.ERROR
    assert first[0].status.description == "ConnectionError: card service down"
    assert second[0].status.status_code is StatusCode.UNSET
    assert first[0].context.trace_id != second[0].context.trace_id  # one trace per attempt
    charges = [s for s in spans.get_finished_spans() if s.name == "charge card"]
    assert sorted(c.parent.span_id for c in charges if c.parent) == sorted(
        s.context.span_id for s, _ in (first, second)
    )
    ((async_span, async_attributes),) = by_job[str(notify_id)]
    assert async_span.name == "process mail"
    assert async_attributes["sqlaq.job.outcome"] == "done"


def test_sqlaq_enqueue_inside_a_span_links_the_worker_span_to_it(
    committed: Engine, spans: InMemorySpanExporter
) -> None:
    registry = sqlaq.Registry()
    registry.handler("ship")(lambda payload: None)
    with _request_span() as request, committed.begin() as conn:
        sqlaq.enqueue(conn, "ship")
    results: list[sqlaq.JobResult] = []
    worker = sqlaq.Worker(
        committed, registry, maintenance=False, burst=True, on_job_finished=results.append
    )
    worker.run()
    (span,) = _processed(spans)
    (link,) = span.links
    assert link.context.trace_id == request.get_span_context().trace_id


def test_a_process_executor_attempt_gets_its_span_with_its_outcome(
    committed: Engine, spans: InMemorySpanExporter
) -> None:
    """Attempts run in child processes get their spans from the worker's dispatcher
    thread (which follows several at once, so none is made current there)."""
    from process_app import registry

    with committed.begin() as conn:
        done = sqlaq.enqueue(conn, "pid").job_id
        failed = sqlaq.enqueue(conn, "fail", max_attempts=1).job_id
    results: list[sqlaq.JobResult] = []
    worker = sqlaq.Worker(
        committed,
        registry,
        executor="process",
        processes=1,
        maintenance=False,
        poll_interval=timedelta(milliseconds=100),
        on_job_finished=results.append,
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: len(results) == 2, 30, "two attempts written")
    finally:
        worker.stop()
        thread.join(10)
    outcomes = {
        (s.attributes or {})["messaging.message.id"]: (
            (s.attributes or {})["sqlaq.job.outcome"],
            s.status.status_code,
        )
        for s in _processed(spans)
    }
    assert outcomes == {
        str(done): ("done", StatusCode.UNSET),
        str(failed): ("failed", StatusCode.ERROR),
    }
