"""Traces of jobs with OpenTelemetry: the ``sqlaq[otel]`` extra.

This module owns sqlaq's two touch points with OpenTelemetry, each a no-op when
``opentelemetry-api`` is not installed (looked for once, here; the enqueue then pays
nothing and the worker a function call per attempt), or while the process has not
imported OpenTelemetry itself: it is imported here only then (configuring a tracer
provider, or starting a span, imports it), so a process that does not trace never loads
it. (A tracer provider named only by ``OTEL_PYTHON_TRACER_PROVIDER``, with nothing
imported, is not looked up.)

* **The enqueue**: :func:`capture` gives the current trace context (the global
  propagator's fields, W3C ``traceparent`` and ``tracestate`` by default) as JSON text
  for the job's ``headers`` column: ``queries.enqueue_stmt(job=..., headers=capture())``.
  None when there is no active span: nothing is stored.
* **The attempt**: :func:`span_for` starts a span around one attempt of a job in the
  worker, after OpenTelemetry's semantic conventions for messaging: kind CONSUMER, name
  ``process <queue>``, attributes ``messaging.system`` (``sqlaq``),
  ``messaging.operation.type`` and ``messaging.operation.name`` (``process``),
  ``messaging.destination.name`` (the queue), ``messaging.message.id`` (the job's id),
  and ``sqlaq.job.kind``, ``sqlaq.job.attempt`` and, when it ends, ``sqlaq.job.outcome``
  (done, retry, failed, snoozed, cancelled). The span is current while the handler runs,
  so the handler's own spans are its children. It starts a trace of its own, *linked* to
  the enqueue's context rather than its child: an attempt may run long after the request
  that enqueued it ended, and each retry is an attempt of its own (the conventions' advice
  for consumers).

It must not import the worker or the operations, even for type checkers: the runner
and the enqueue path call in, never the other way. What it reads of a run and of an
outcome is spelt as a protocol here (:class:`AttemptOf`, :class:`Ended`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode

    from sqlaq.records import ClaimedJob


__all__ = [
    "ENABLED",
    "SYSTEM",
    "AttemptOf",
    "AttemptSpan",
    "Ended",
    "capture",
    "end",
    "links",
    "span_for",
    "start",
]


class AttemptOf(Protocol):
    """What :func:`span_for` reads of a worker's run (:class:`sqlaq.worker.run.Run`)."""

    @property
    def job(self) -> ClaimedJob:
        """The claimed job the run is an attempt of."""
        ...


class Ended(Protocol):
    """What :func:`end` reads of an attempt's outcome (:class:`sqlaq.outcome.Outcome`)."""

    @property
    def verdict(self) -> str:
        """What became of the attempt (done, retry, failed, ...)."""
        ...

    @property
    def error(self) -> str | None:
        """The summary written to ``last_error``, if any."""
        ...


def _installed() -> bool:
    try:
        return find_spec("opentelemetry.trace") is not None
    except (ImportError, ValueError):  # pragma: no cover - a broken install
        return False


#: Whether the ``sqlaq[otel]`` extra is installed (without it every function here is a
#: no-op). Whether it is *used* is decided on each call: see :func:`_in_use`.
ENABLED = _installed()
_loaded = False


def _in_use() -> bool:
    """Whether tracing is in use, OpenTelemetry imported here on the first call that says
    so: the extra is installed and this process has imported ``opentelemetry.context``.

    Whoever configures a tracer provider, starts a span or sets baggage has imported it;
    until then there is no context to capture and a span would record nothing, so a
    process that does not trace (a worker, by default) never loads OpenTelemetry's ~20
    modules (~5 MiB).
    """
    global _loaded
    if _loaded:
        return True
    if not ENABLED or "opentelemetry.context" not in sys.modules:
        return False
    _load()
    return True


def _load() -> None:
    global otel_context, propagate, trace, Link, SpanKind, Status, StatusCode, _loaded
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode

    _loaded = True


#: ``messaging.system`` of sqlaq's spans.
SYSTEM = "sqlaq"
#: Outcomes that mark the attempt's span as an error.
_ERRORS = frozenset({"retry", "failed"})


def capture() -> str | None:
    """The current trace context as JSON text, for a job's ``headers``; None without
    ``sqlaq[otel]`` or outside any span."""
    if not _in_use():
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return json.dumps(carrier, separators=(",", ":"), sort_keys=True) if carrier else None


def links(headers: Mapping[str, Any] | str | None) -> list[Any]:
    """The span links to the trace context in *headers* (a job's ``headers``: a dict, or
    its JSON text); empty when it holds none, or without ``sqlaq[otel]``."""
    if not headers or not _in_use():
        return []
    if isinstance(headers, str):
        try:
            headers = json.loads(headers)
        except ValueError:
            return []
    if not isinstance(headers, Mapping):
        return []
    carrier = {str(k): str(v) for k, v in headers.items()}
    span_context = trace.get_current_span(propagate.extract(carrier)).get_span_context()
    return [Link(span_context)] if span_context.is_valid else []


class AttemptSpan:
    """The span of one attempt, current in the context that started it until :func:`end`."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Any, token: Any) -> None:
        self._span = span
        self._token = token

    @property
    def span(self) -> Any:
        """The OpenTelemetry span."""
        return self._span


def start(
    *,
    job_id: int,
    kind: str,
    queue: str,
    attempt: int,
    headers: Mapping[str, Any] | str | None = None,
    current: bool = True,
) -> AttemptSpan | None:
    """Start the span of one attempt and make it current (in this thread, or this
    asyncio task); None without ``sqlaq[otel]``. End it with :func:`end` in the same
    thread or task. *current* False: the span is not made current (a thread that
    follows many attempts at once, as the process executor's dispatcher does)."""
    if not _in_use():
        return None
    tracer = trace.get_tracer("sqlaq")
    span = tracer.start_span(
        f"process {queue}",
        # A trace of its own, whatever happens to be current in the worker's thread or
        # the host's event loop: the enqueue's is a link.
        context=otel_context.Context(),
        kind=SpanKind.CONSUMER,
        links=links(headers),
        attributes={
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": queue,
            "messaging.message.id": str(job_id),
            "sqlaq.job.kind": kind,
            "sqlaq.job.attempt": attempt,
        },
    )
    token = otel_context.attach(trace.set_span_in_context(span)) if current else None
    return AttemptSpan(span, token)


def span_for(run: AttemptOf, *, current: bool = True) -> AttemptSpan | None:
    """:func:`start` for the run of a worker (its job's id, kind, queue, attempt and
    headers); None without ``sqlaq[otel]``, or while this process has not imported
    OpenTelemetry. *current*: as :func:`start`'s."""
    if not _in_use():
        return None
    job = run.job
    return start(
        job_id=job.id,
        kind=job.kind,
        queue=job.queue,
        attempt=job.attempt,
        headers=getattr(job, "headers", None),
        current=current,
    )


def end(attempt: AttemptSpan | None, outcome: Ended | None) -> None:
    """End the span of an attempt with its *outcome* (None: the attempt did not end,
    the worker stopped it) and make the context before it current again."""
    if attempt is None:
        return
    span = attempt.span
    if outcome is not None:
        verdict = str(outcome.verdict)
        span.set_attribute("sqlaq.job.outcome", verdict)
        if verdict in _ERRORS:
            first_line = (outcome.error or "").partition("\n")[0]
            span.set_status(Status(StatusCode.ERROR, first_line))
    if attempt._token is not None:
        otel_context.detach(attempt._token)
    span.end()
