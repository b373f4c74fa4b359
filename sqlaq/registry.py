"""The registry: job kind -> handler, with the per-kind options.

This module owns what a worker needs to know about a kind before running it: the
function, whether it is ``async``, the default ``max_attempts``, the lease, the retry
policy (which exceptions retry, and how long to wait), its global limits (concurrency
and rate, see :mod:`sqlaq.limits`), and the periodic jobs (:mod:`sqlaq.periodic`). It
runs no job and no SQL except through :mod:`sqlaq.ops` in :meth:`Registry.enqueue`.

Retry policies speak tenacity's vocabulary, so ``retry=tenacity.retry_if_exception_type(
IOError)`` and ``wait=tenacity.wait_exponential_jitter(...)`` work as they do with
tenacity. They are evaluated on a :class:`tenacity.RetryCallState` built for the failed
attempt (its number and its exception), since the "retry loop" here spans processes and
the job row, not one Python call. ``stop`` has no equivalent: the job row's
``max_attempts`` is the stop, and the fail statement applies it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypedDict, TypeVar, Unpack, cast
from zoneinfo import ZoneInfo

import tenacity

from sqlaq import ops
from sqlaq.backoff import DEFAULT_BACKOFF, Backoff
from sqlaq.bounds import MAX_DURATION, MIN_LEASE, clamp_duration, duration_from_seconds
from sqlaq.encoding import NewJob, check_name
from sqlaq.errors import ConfigError, InvalidJobError, PermanentError
from sqlaq.limits import Rate
from sqlaq.option import COUNT, Boolean, Domain, Duration
from sqlaq.periodic import Periodic
from sqlaq.schema import DEFAULT_MAX_ATTEMPTS, DEFAULT_QUEUE

__all__ = ["Handler", "HandlerOptions", "Registry", "RetryPolicy", "WaitPolicy"]

#: A handler: called with the job's payload; a coroutine function is awaited.
HandlerFunc = Callable[[dict[str, Any]], object]
#: Which failures retry: a tenacity ``retry_*`` predicate (any callable taking a
#: ``RetryCallState``), or an exception class or tuple of them.
RetryPolicy = (
    Callable[[tenacity.RetryCallState], bool]
    | type[BaseException]
    | tuple[type[BaseException], ...]
)
#: How long to wait before the next attempt: a :class:`~sqlaq.Backoff`, or a tenacity
#: ``wait_*`` strategy (any callable taking a ``RetryCallState`` and returning seconds).
WaitPolicy = Backoff | Callable[[tenacity.RetryCallState], float]

F = TypeVar("F", bound=Callable[..., object])

# Built once: some tenacity strategies look at the state's retry object, none of the
# retry_*/wait_* ones change it.
_RETRYING = tenacity.Retrying()
_DEFAULT_RETRY = tenacity.retry_if_not_exception_type(PermanentError)


class HandlerOptions(TypedDict, total=False):
    """The options of a kind, given to :meth:`Registry.handler` and :meth:`Registry.add`
    as keywords (all optional). Each is checked when the handler is registered, with the
    bounds the worker's settings and the enqueue use (:mod:`sqlaq.bounds`): a lease from
    100 ms to 100 years, counts (*max_attempts*, *concurrency*, *key_concurrency*) from 1
    to 2,147,483,647 (PostgreSQL's ``integer``); a value outside raises
    :class:`~sqlaq.ConfigError` there, not when a worker first uses it.

    Attributes:
        max_attempts: The default :meth:`Registry.enqueue` gives jobs of this kind.
        lease: Keep this lease while a job of this kind runs, instead of the
            worker's: longer for work that may stall between heartbeats.
        retry: Which exceptions retry: a tenacity ``retry_*`` predicate, or an
            exception class or tuple of them. Default: all but PermanentError,
            which never retries whatever the predicate says.
        wait: The delay before the next attempt: a :class:`~sqlaq.Backoff` or a
            tenacity ``wait_*`` strategy. Default: :data:`~sqlaq.DEFAULT_BACKOFF`.
        concurrency: At most this many jobs of the kind run at once across every
            worker and process, enforced by the database at claim time. Other kinds
            keep flowing while it is full.
        rate: At most this many job starts per period across every worker:
            ``"1/s"``, ``"100/m"``, ``"1000/h"``, ``"10/30s"`` or a
            :class:`~sqlaq.Rate`. Jobs over the rate stay queued and keep their
            attempts. See :mod:`sqlaq.limits` for how both are enforced.
        transaction: Run the handler in the job's transaction: it gets a SQLAlchemy
            ``Session`` (an ``AsyncSession`` for ``async def``) as its ``session``
            parameter (and as ``current_job().session``), and after it returns the
            worker completes the job in that same transaction, fenced by the lease,
            then commits: its writes and the job's ``done`` commit together, or not
            at all. Default: True when the function has a parameter named
            ``session``.
        timeout: How long one attempt may run. An ``async`` handler is cancelled
            at the deadline; a sync one cannot be interrupted (Python has no way to
            stop a thread), so at the deadline its attempt is recorded as timed out
            (retried or failed per *retry* and *wait*, its ``last_error`` saying
            "timed out after ..."), due again no sooner than its lease length, so
            another worker takes it only once the lease it held has run out; its
            slot stays taken until the thread returns, and whatever it returns
            then is not written. A sync handler that returns after its deadline
            has timed out all the same, never done; a transactional one has its
            transaction rolled back. With ``executor="process"`` a sync handler
            past its deadline is killed instead (its child process), its slot
            freed at once.
        key_concurrency: At most this many jobs of one key (``enqueue(...,
            key=...)``: a tenant, an account) of the kind run at once across every
            worker, enforced by the database at claim time like *concurrency*; other
            keys keep flowing while one is full. Jobs without a key are not limited
            by it.
        ordered: Strict order per key: the jobs of one key of the kind run one at a
            time, in enqueue order. A job waits while an earlier job of its key is
            queued (a retry's wait holds the line), running, or failed for good: a
            failed job holds its key until it is retried or deleted (see
            ``docs/how-to/tenants.md``). Implies ``key_concurrency=1``.
        executor: Where this kind's sync handler runs: ``"thread"``, on the worker's
            threads; ``"process"``, in the worker's pool of child processes (every
            core for CPU-bound work, a hard timeout; see
            :mod:`sqlaq.worker.processes`); None (the default): the worker's
            ``executor``. ``"process"`` is refused for an ``async`` or a
            transactional handler (their work is the worker's event loop or its
            transaction); the function must be importable by its module and name (a
            module-level function), as the child imports it.
    """

    max_attempts: int
    lease: timedelta | None
    retry: RetryPolicy | None
    wait: WaitPolicy | None
    concurrency: int | None
    rate: Rate | str | None
    transaction: bool | None
    timeout: timedelta | None
    key_concurrency: int | None
    ordered: bool
    executor: Literal["thread", "process"] | None


@dataclass(frozen=True, slots=True)
class Handler:
    """A registered handler and its options. Build it with :meth:`Registry.handler`.

    Attributes:
        kind: The job kind it runs.
        func: The function, called with the payload.
        is_async: True for an ``async def`` handler (run on the worker's event loop).
        max_attempts: The default :meth:`Registry.enqueue` uses; the job row's own
            ``max_attempts`` is what the worker honours.
        lease: The lease length kept while this kind runs, or None for the worker's.
        retry: Which failures retry (a tenacity predicate).
        wait: The delay before the next attempt.
        concurrency: At most this many jobs of the kind run at once across all
            workers, or None for no limit.
        rate: At most this many starts per period across all workers, or None.
        transaction: The handler runs in the job's transaction: its writes commit with
            the job's completion (see :meth:`Registry.handler`).
        takes_session: It declares a ``session`` parameter, passed by keyword.
        timeout: How long one attempt may run, or None for no limit.
        key_concurrency: At most this many jobs of one key run at once across all
            workers, or None for no per-key limit (1 when *ordered*).
        ordered: The jobs of one key run one at a time, in enqueue order.
        executor: Where its sync handler runs: ``"thread"``, ``"process"``, or None
            for the worker's ``executor``.
    """

    kind: str
    func: HandlerFunc
    is_async: bool
    max_attempts: int
    lease: timedelta | None
    retry: Callable[[tenacity.RetryCallState], bool]
    wait: WaitPolicy
    concurrency: int | None = None
    rate: Rate | None = None
    transaction: bool = False
    takes_session: bool = False
    timeout: timedelta | None = None
    key_concurrency: int | None = None
    ordered: bool = False
    executor: str | None = None

    @property
    def limited(self) -> bool:
        """True when the kind has a concurrency limit, a rate, or a per-key limit:
        its jobs are claimed under its lock (:func:`sqlaq.claim_limited`)."""
        return self.concurrency is not None or self.rate is not None or self.keyed

    @property
    def keyed(self) -> bool:
        """True when the kind limits its jobs per key (``key_concurrency`` or
        ``ordered``)."""
        return self.key_concurrency is not None

    def retry_in(self, attempt: int, error: BaseException) -> timedelta | None:
        """The delay before retrying after *error* ended attempt number *attempt*.

        Returns:
            None when *error* must not be retried: a :class:`~sqlaq.PermanentError`
            (always), or an error the retry predicate rejects. Whether attempts are
            left is the job row's business (``max_attempts``), not this method's.
        """
        if isinstance(error, PermanentError):
            return None
        state = tenacity.RetryCallState(_RETRYING, fn=self.func, args=(), kwargs={})
        state.attempt_number = attempt
        state.set_exception((type(error), error, error.__traceback__))
        if not self.retry(state):
            return None
        if isinstance(self.wait, Backoff):
            return clamp_duration(self.wait(attempt))
        # Clamped to [0, MAX_DURATION]: a wait of 1e30 seconds is "as late as storable".
        return duration_from_seconds(float(self.wait(state)))


class Registry:
    """Maps job kinds to handlers. Give it to a :class:`~sqlaq.Worker` or to
    ``sqlaq-worker module:attribute``.

    Example::

        registry = sqlaq.Registry()

        @registry.handler("send_email", max_attempts=10,
                          retry=tenacity.retry_if_exception_type(IOError))
        def send_email(payload: dict[str, Any]) -> None:
            ...
    """

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._periodic: dict[str, Periodic] = {}

    def handler(self, kind: str, **options: Unpack[HandlerOptions]) -> Callable[[F], F]:
        """Register the decorated function as the handler of *kind*.

        The function is called with the job's payload (a dict) as its one argument; it
        may be ``async def``. It is returned unchanged, so it stays callable directly.

        Args:
            kind: The job kind, as enqueued.
            **options: The kind's options, each described in :class:`HandlerOptions`:
                ``max_attempts``, ``lease``, ``retry``, ``wait``, ``concurrency``,
                ``rate``, ``transaction``, ``timeout``, ``key_concurrency``,
                ``ordered``, ``executor``.

        Raises:
            ConfigError: the kind is not a usable name or is already registered, or an
                option is unknown or unusable.
        """

        _check_option_names(kind, options)  # at the decorator's line, not at its call

        def register(func: F) -> F:
            self.add(kind, func, **options)
            return func

        return register

    def periodic(
        self,
        schedule: str,
        *,
        kind: str | None = None,
        payload: Mapping[str, Any] | None = None,
        name: str | None = None,
        queue: str = DEFAULT_QUEUE,
        priority: int = 0,
        max_attempts: int | None = None,
        backfill: bool = False,
        tz: ZoneInfo | str | None = None,
    ) -> Callable[[F], F]:
        """Enqueue a job of *kind* on the cron *schedule*, and register the decorated
        function as its handler if the kind has none yet.

        Every worker running this registry enqueues due slots, and the database makes
        sure each slot is enqueued once (see :mod:`sqlaq.periodic`)::

            @registry.periodic("0 * * * *", kind="hourly_report", payload={"scope": "all"})
            def hourly_report(payload): ...

        With *tz* the schedule is read on that time zone's wall clock::

            @registry.periodic("0 9 * * mon-fri", kind="digest", tz="Europe/Paris")
            def digest(payload): ...

        To give the handler options, put ``@registry.periodic`` above
        ``@registry.handler(...)``; to schedule a kind registered elsewhere, call
        :meth:`add_periodic`.

        Args:
            schedule: 5-field cron (``minute hour day month weekday``), in UTC unless
                *tz* is given; or ``@hourly``, ``@daily``, ``@weekly``, ``@monthly``,
                ``@yearly``.
            kind: The job's kind; default the function's name.
            payload: The job's payload (the same for every slot).
            name: Unique name of this schedule; default the kind.
            queue: The job's queue.
            priority: The job's priority.
            max_attempts: The job's; default the handler's.
            backfill: After a time with no worker running, enqueue every missed slot
                (the latest 1000), not only the latest one.
            tz: The IANA time zone the schedule is read in (a
                :class:`~zoneinfo.ZoneInfo` or its name, e.g. ``"Europe/Paris"``);
                default UTC. When daylight saving time skips an hour, a slot in it runs
                once, at the first instant after the gap (03:00 for 02:30); when it
                repeats an hour, a slot in it runs once, at its first occurrence.

        Raises:
            ConfigError: a bad schedule, time zone or option, or a name already
                scheduled.
        """

        def register(func: F) -> F:
            the_kind = kind if kind is not None else getattr(func, "__name__", "")
            existing = self._handlers.get(the_kind)
            if existing is None:
                self.add(the_kind, cast("HandlerFunc", func))
            elif existing.func is not func:
                raise ConfigError(
                    f"kind {the_kind!r} already has another handler ({existing.func!r}); "
                    f"@registry.periodic would never call {func!r}: use "
                    "registry.add_periodic to schedule that kind"
                )
            self.add_periodic(
                schedule,
                kind=the_kind,
                payload=payload,
                name=name,
                queue=queue,
                priority=priority,
                max_attempts=max_attempts,
                backfill=backfill,
                tz=tz,
            )
            return func

        return register

    def add_periodic(
        self,
        schedule: str,
        *,
        kind: str,
        payload: Mapping[str, Any] | None = None,
        name: str | None = None,
        queue: str = DEFAULT_QUEUE,
        priority: int = 0,
        max_attempts: int | None = None,
        backfill: bool = False,
        tz: ZoneInfo | str | None = None,
    ) -> Periodic:
        """Schedule jobs of the registered *kind*: :meth:`periodic` without a function.

        Raises:
            ConfigError: *kind* has no handler here, or as :meth:`periodic`.
        """
        entry = self._require(kind)
        periodic = Periodic.build(
            schedule,
            kind=kind,
            name=name,
            payload=payload,
            queue=queue,
            priority=priority,
            max_attempts=entry.max_attempts if max_attempts is None else max_attempts,
            backfill=backfill,
            tz=tz,
        )
        if periodic.name in self._periodic:
            raise ConfigError(
                f"a periodic job named {periodic.name!r} is already scheduled; pass name=..."
            )
        self._periodic[periodic.name] = periodic
        return periodic

    @property
    def periodics(self) -> list[Periodic]:
        """The periodic jobs, by name."""
        return [self._periodic[name] for name in sorted(self._periodic)]

    def add(self, kind: str, func: HandlerFunc, **options: Unpack[HandlerOptions]) -> Handler:
        """Register *func* as the handler of *kind*; the non-decorator form of
        :meth:`handler`, with the same options (:class:`HandlerOptions`).

        Returns:
            The registered :class:`Handler`.
        """
        try:
            check_name("kind", kind)
        except InvalidJobError as exc:
            raise ConfigError(str(exc)) from exc
        if kind in self._handlers:
            raise ConfigError(f"kind {kind!r} already has a handler: {self._handlers[kind].func!r}")
        if not callable(func):
            raise ConfigError(f"the handler of {kind!r} must be callable, got {func!r}")
        _check_option_names(kind, options)
        given: dict[str, Any] = dict(options)
        resolved: dict[str, Any] = {
            name: check(kind, given.get(name, default))
            for name, (default, check) in _OPTIONS.items()
        }
        takes_session = _takes_session(func)
        resolved["transaction"] = _check_transaction(kind, given.get("transaction"), takes_session)
        if resolved["ordered"]:
            if resolved["key_concurrency"] not in (None, 1):
                raise ConfigError(
                    f"{kind!r} is ordered: one job of a key runs at a time, so "
                    f"key_concurrency must be 1 or left out, got {resolved['key_concurrency']!r}"
                )
            resolved["key_concurrency"] = 1
        is_async = inspect.iscoroutinefunction(func)
        if resolved["executor"] == "process" and (is_async or resolved["transaction"]):
            sort = "an async" if is_async else "a transactional"
            raise ConfigError(
                f'executor="process" of {kind!r}: {sort} handler runs in the worker\'s '
                "process; only plain sync (def) handlers can run in a child process"
            )
        entry = Handler(
            kind=kind,
            func=func,
            is_async=is_async,
            takes_session=takes_session,
            **resolved,
        )
        self._handlers[kind] = entry
        return entry

    def get(self, kind: str) -> Handler | None:
        """The handler of *kind*, or None."""
        return self._handlers.get(kind)

    def __contains__(self, kind: object) -> bool:
        return kind in self._handlers

    def __iter__(self) -> Iterator[Handler]:
        return iter(self._handlers.values())

    def __len__(self) -> int:
        return len(self._handlers)

    @property
    def kinds(self) -> list[str]:
        """The registered kinds, sorted."""
        return sorted(self._handlers)

    def new_job(
        self, kind: str, payload: Mapping[str, Any] | None = None, **options: Any
    ) -> NewJob:
        """A :class:`~sqlaq.NewJob` of a registered *kind*, for :func:`sqlaq.enqueue_many`.

        ``max_attempts`` defaults to the handler's; other *options* are NewJob's.

        Raises:
            ConfigError: *kind* has no handler here.
            InvalidJobError: bad input.
        """
        entry = self._require(kind)
        options.setdefault("max_attempts", entry.max_attempts)
        return NewJob(kind=kind, payload={} if payload is None else payload, **options)

    def enqueue(
        self,
        conn: ops.Executor,
        kind: str,
        payload: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> ops.EnqueueResult:
        """Enqueue a job of a registered *kind* in the caller's transaction.

        Like :func:`sqlaq.enqueue` (same *options*: queue, priority, delay, dedupe_key,
        max_attempts), but ``max_attempts`` defaults to the handler's, and a kind with
        no handler here is refused before anything is written.

        Raises:
            ConfigError: *kind* has no handler here.
            InvalidJobError: bad input; nothing was written.
        """
        entry = self._require(kind)
        options.setdefault("max_attempts", entry.max_attempts)
        return ops.enqueue(conn, kind, payload, **options)

    def _require(self, kind: str) -> Handler:
        entry = self._handlers.get(kind)
        if entry is None:
            raise ConfigError(f"no handler for kind {kind!r}; registered kinds: {self.kinds}")
        return entry


def _takes_session(func: Callable[..., object]) -> bool:
    try:
        parameters = inspect.signature(func).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    session = parameters.get("session")
    return session is not None and session.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


def _check_transaction(kind: str, value: object, takes_session: bool) -> bool:
    if value is None:
        return takes_session
    if not isinstance(value, bool):
        raise ConfigError(f"transaction of {kind!r} must be a bool or None, got {value!r}")
    if takes_session and not value:
        raise ConfigError(
            f"the handler of {kind!r} takes a session parameter but transaction=False: "
            "drop the parameter, or let it run in the job's transaction"
        )
    return value


def _check_timeout(kind: str, value: object) -> timedelta | None:
    if value is None:
        return None
    if not isinstance(value, timedelta) or not timedelta(0) < value <= MAX_DURATION:
        raise ConfigError(
            f"timeout of {kind!r} must be a timedelta above 0 and at most 100 years, got {value!r}"
        )
    return value


def _check_executor(kind: str, value: object) -> str | None:
    if value is None or (isinstance(value, str) and value in ("thread", "process")):
        return value
    raise ConfigError(f'executor of {kind!r} must be "thread", "process" or None, got {value!r}')


def _in(name: str, domain: Domain[Any], *, optional: bool = True) -> Callable[[str, object], Any]:
    """The check of the option *name*: a value of *domain* (the same bounds as the
    worker's settings and the commands, :mod:`sqlaq.option`), or None where *optional*;
    the message names the option and the kind (``lease of 'send' must be ...``)."""

    def check(kind: str, value: object) -> Any:
        if value is None and optional:
            return None
        return domain.check(value, f"{name} of {kind!r}")

    return check


def _check_rate(kind: str, value: object) -> Rate | None:
    if value is None or isinstance(value, Rate):
        return value
    if isinstance(value, str):
        try:
            return Rate.parse(value)
        except ConfigError as exc:
            raise ConfigError(f"rate of {kind!r}: {exc}") from None
    raise ConfigError(
        f"rate of {kind!r} must be a str such as '5/s' or a sqlaq.Rate, got {value!r}"
    )


def _retry_predicate(
    kind: str, value: RetryPolicy | None
) -> Callable[[tenacity.RetryCallState], bool]:
    if value is None:
        return _DEFAULT_RETRY
    # Classes are callable too: recognise exception classes before treating the value as
    # a predicate, or IOError(state) would "return" a truthy exception instance.
    if isinstance(value, type) and issubclass(value, BaseException):
        return tenacity.retry_if_exception_type(value)
    if isinstance(value, tuple) and all(
        isinstance(v, type) and issubclass(v, BaseException) for v in value
    ):
        return tenacity.retry_if_exception_type(value)
    if callable(value):
        return cast("Callable[[tenacity.RetryCallState], bool]", value)
    raise ConfigError(
        f"retry of {kind!r} must be a tenacity retry_* predicate or exception class(es), "
        f"got {value!r}"
    )


def _wait_policy(kind: str, value: WaitPolicy | None) -> WaitPolicy:
    if value is None:
        return DEFAULT_BACKOFF
    if isinstance(value, Backoff) or callable(value):
        return value
    raise ConfigError(
        f"wait of {kind!r} must be a sqlaq.Backoff or a tenacity wait_* strategy, got {value!r}"
    )


def _check_option_names(kind: str, options: Mapping[str, object]) -> None:
    for name in options:
        if name not in _OPTIONS:
            import difflib  # a misspelt name only: not imported by a worker

            near = difflib.get_close_matches(name, _OPTIONS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(
                f"the handler of {kind!r} has no option {name!r}{hint}; "
                f"its options: {', '.join(_OPTIONS)}"
            )


def _no_check(kind: str, value: object) -> object:
    return value  # transaction: checked with the function (takes it a session?)


#: Each option of :class:`HandlerOptions`: its default and its check (which also turns
#: it into the :class:`Handler`'s field of the same name). The one list of the options.
_OPTIONS: dict[str, tuple[object, Callable[[str, Any], object]]] = {
    "max_attempts": (DEFAULT_MAX_ATTEMPTS, _in("max_attempts", COUNT, optional=False)),
    "lease": (None, _in("lease", Duration(minimum=MIN_LEASE))),
    "retry": (None, _retry_predicate),
    "wait": (None, _wait_policy),
    "concurrency": (None, _in("concurrency", COUNT)),
    "rate": (None, _check_rate),
    "transaction": (None, _no_check),
    "timeout": (None, _check_timeout),
    "key_concurrency": (None, _in("key_concurrency", COUNT)),
    "ordered": (False, _in("ordered", Boolean(), optional=False)),
    "executor": (None, _check_executor),
}
