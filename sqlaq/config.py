"""The worker's configuration: one frozen dataclass, its defaults, and its options table.

This module owns the names, defaults, bounds and help of every worker option, each
declared once, as a field of :class:`WorkerConfig` (see :func:`_setting`). The Python
API (``sqlaq.Worker(engine, registry, concurrency=8)``) validates from those
declarations, and the ``sqlaq-worker`` command builds its flags, ``SQLAQ_*`` variables
and ``--help`` from them (:data:`WORKER_OPTIONS`), so both refuse the same values. It
must not read the environment (only the commands do) nor touch a database.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from sqlaq.bounds import MIN_LEASE
from sqlaq.errors import ConfigError
from sqlaq.ops import DEFAULT_LEASE
from sqlaq.option import (
    AutoInteger,
    Boolean,
    Choice,
    Condition,
    DatabaseUrl,
    Domain,
    Duration,
    Integer,
    Names,
    Option,
    Weights,
)
from sqlaq.schema import DEFAULT_QUEUE, JobStatus

if TYPE_CHECKING:
    from sqlalchemy import ColumnElement

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_GRACE_PERIOD",
    "DEFAULT_LEASE",
    "DEFAULT_MAINTENANCE_INTERVAL",
    "DEFAULT_POLL_INTERVAL",
    "DEFAULT_QUEUES",
    "DEFAULT_RETAIN_DONE",
    "DEFAULT_RETAIN_FAILED",
    "DEFAULT_RETENTION",
    "DEFAULT_START_TIMEOUT",
    "EXECUTORS",
    "MAX_CONCURRENCY",
    "MAX_PROCESSES",
    "WORKER_OPTIONS",
    "WorkerConfig",
    "check_options",
]

#: The queues a worker serves when none is named: ``("default",)``.
DEFAULT_QUEUES: tuple[str, ...] = (DEFAULT_QUEUE,)
#: Jobs run at once, at most: sync handlers each hold a thread, async ones a slot on the
#: loop. A ceiling, not a cost: threads start only as jobs need them (ten due jobs start
#: ten), and claims take only what is due. With transactional handlers the default is
#: lowered to what the engine's pool holds.
DEFAULT_CONCURRENCY = 100
#: How often the worker looks for due jobs without being notified: scheduled jobs,
#: retries, expired leases, and notifications lost while the listener was down.
DEFAULT_POLL_INTERVAL = timedelta(seconds=5)
#: How long a stopping worker lets running jobs finish before handing them back.
DEFAULT_GRACE_PERIOD = timedelta(seconds=30)
#: How long a starting worker retries a database that is unavailable (restarting).
DEFAULT_START_TIMEOUT = timedelta(seconds=30)
#: How often the maintenance thread runs: periodic jobs are also enqueued at each slot
#: boundary, whatever the interval; the leader prunes and sweeps once per interval.
DEFAULT_MAINTENANCE_INTERVAL = timedelta(seconds=60)
#: The leader deletes done and cancelled jobs this long after they finished...
DEFAULT_RETAIN_DONE = timedelta(days=7)
#: ... and failed jobs this long after (kept longer: someone may want to retry them).
DEFAULT_RETAIN_FAILED = timedelta(days=30)
#: The two by status: how old a finished job is when ``sqlaq prune`` and the dashboard's
#: prune delete it, unless told otherwise (what the leader would delete).
DEFAULT_RETENTION: Mapping[JobStatus, timedelta] = MappingProxyType(
    {
        JobStatus.DONE: DEFAULT_RETAIN_DONE,
        JobStatus.CANCELLED: DEFAULT_RETAIN_DONE,
        JobStatus.FAILED: DEFAULT_RETAIN_FAILED,
    }
)
#: Upper bound of concurrency (and prefetch): each sync slot is a thread.
MAX_CONCURRENCY = 10_000
#: Where sync handlers run (:mod:`sqlaq.worker.processes`): ``thread``, the worker's
#: own threads, or ``process``, a pool of child processes.
EXECUTORS = ("thread", "process")
#: Upper bound of ``processes``, the child processes of the process executor.
MAX_PROCESSES = 1024

_OPTION = "sqlaq.option"


def _option(domain: Domain[Any], help: str, **more: Any) -> dict[str, Option]:
    """The metadata of a :class:`WorkerConfig` field declaring its option.

    *more* goes to :class:`~sqlaq.option.Option` (``flag=``, ``repeatable=``...). The
    option's name and default are the field's, filled in by :data:`WORKER_OPTIONS`.
    """
    return {_OPTION: Option("", domain, None, help, **more)}


_MS = timedelta(milliseconds=1)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Every option of a :class:`~sqlaq.Worker`, validated on construction.

    Every duration is at most :data:`~sqlaq.bounds.MAX_DURATION` (100 years).

    Args:
        queues: The queues served, claimed one statement per queue in turn (round robin).
            A single name is accepted for one queue.
        concurrency: Jobs run at once (1 to 10,000); the claim size is the number of
            free slots.
        prefetch: Jobs claimed ahead of free slots (0 to 10,000), held in memory (their
            leases renewed like running ones), so a slot that frees starts its next job
            at once instead of after a claim's round trip: more throughput for short
            handlers, at the price of jobs waiting in one worker while another may be
            idle. Limited kinds are never prefetched: they are claimed only for a slot
            free now, which a worker kept busy by prefetched work seldom has, so serve
            them from workers with ``prefetch=0``. None (the default, ``auto``) follows
            the worker's pace (:mod:`sqlaq.worker.pacing`): a few claims' worth of jobs
            (``4 x jobs/s x claim seconds``, at most twice the concurrency and 1,000)
            while the last claim came back full, none while the queue is shallow; fast
            handlers get a deep prefetch, slow ones next to none. 0 claims only for free
            slots.
        lease: How long a claim holds a job before another worker may take it (at least
            100 ms). The worker renews it every ``lease / 3`` while the handler runs, so
            it bounds how long a crashed worker's jobs wait, not how long a job may run.
            A handler's own ``lease`` overrides it for that kind.
        poll_interval: Look for due jobs at least this often, notified or not (at least
            10 ms).
        grace_period: On stop, how long running jobs may finish before they are handed
            back to the queue (status queued, due now, attempt refunded).
        start_timeout: At start, how long to keep retrying a database that is
            unavailable (a server restarting, refused or dropped connections: the
            transient faults of :func:`sqlaq.transient.is_transient`) before giving up
            with :class:`~sqlaq.errors.DatabaseUnavailableError`; 0 tries once. Other
            faults (no schema, missing privileges) fail at once.
        burst: Run what is due, then stop (instead of waiting for more).
        listen: Wake on ``NOTIFY`` through a dedicated LISTEN connection. Without it the
            worker relies on polling alone.
        listen_url: A URL that reaches PostgreSQL directly, for the two connections that
            need a session of their own: the LISTEN connection and the maintenance
            leader's (its advisory lock). Set it when the engine goes through PgBouncer
            in transaction pooling, which breaks both; None (the default) uses the
            engine's URL. A ``str`` or SQLAlchemy ``URL`` (kept as text); any
            ``postgresql`` driver is accepted, psycopg is used.
        maintenance: Run the maintenance thread: enqueue the registry's periodic jobs,
            and take part in the leader election for retention and the expired-lease
            sweep. Off in burst mode whatever this says.
        maintenance_interval: How often the maintenance thread wakes (periodic jobs
            are also enqueued at each slot boundary), and so how soon another worker
            takes over from a leader that died (at least 10 ms).
        retain_done: The leader deletes done and cancelled jobs finished longer ago;
            None keeps them for ever.
        retain_failed: The leader deletes failed jobs finished longer ago; None keeps
            them for ever.
        vacuum: During a deep drain, vacuum the jobs table when the jobs this worker
            claimed have left enough dead row versions, without waiting for
            autovacuum's next look (:mod:`sqlaq.worker.vacuum`; needs the table's
            owner, or ``MAINTAIN`` on it on PostgreSQL 17+). False leaves it to
            autovacuum.
        where: Serve only the jobs matching this condition (worker affinity): a
            SQLAlchemy boolean clause over :data:`sqlaq.jobs` columns
            (``sqlaq.jobs.c.payload["region"].astext == "eu"``), a sequence of them
            (AND-ed), or SQL text over the table's columns (``payload->>'region' =
            'eu'``, what ``--where`` gives; see :func:`sqlaq.queries.where_text`). It
            goes into every claim, inside its locking subquery: other jobs are neither
            claimed nor locked, and are left to other workers. The limits of limited
            kinds stay global. Checked against the table when the worker starts.
            None (the default) claims every job of the queues.
        executor: Where sync (``def``) handlers run: ``"thread"`` (the default), on the
            worker's threads; or ``"process"``, in a pool of child processes
            (:mod:`sqlaq.worker.processes`): CPU-bound handlers get every core, and a
            handler past its ``timeout`` is killed. A handler's own ``executor``
            option overrides it for that kind; ``async`` and transactional handlers
            always run in the worker's process.
        processes: How many child processes the process executor keeps (1 to 1,024);
            None (the default, ``auto``) is the number of CPUs the worker may run on;
            never more than ``concurrency``. They start with the worker. A child runs
            one job at a time; the worker's other jobs in hand (up to ``concurrency``)
            wait for a free child, their leases kept and their timeouts not started:
            short handlers need jobs waiting (claims then come in batches), while a
            worker sharing long jobs with others may set ``concurrency`` to this number.
        max_jobs_per_child: A child process is replaced after running this many jobs
            (0, the default: never): for handlers that leak.
        max_memory_per_child: A child process whose resident memory exceeds this many
            MiB after a job is replaced (0, the default: no ceiling). The child reads
            its own RSS after each job (``/proc/self/statm`` on Linux; elsewhere its
            peak RSS, ``getrusage``); a job is never cut short for it.

        fair: The queues claimed fairly across keys (:func:`sqlaq.claim_fair`): each
            claim spreads over the keys with due jobs (a job without a key takes the
            slots the keys leave), weighted by *key_weights*, so a key that floods the
            queue gets its share of this worker, not all of it. Other queues keep the plain claim
            order; a name of a queue this worker does not serve changes nothing. Give
            every worker of a queue the same setting: a worker without it still claims
            each job once, in plain order. () (the default): none.
        key_weights: The weight of a key in the fair queues (a positive int; 1 for the
            keys not named), as a mapping (``{"vip": 3}``) or (key, weight) pairs, held
            as pairs in key order: a key of weight 3 gets three times the share of a key
            of weight 1 while both have due jobs.

    Raises:
        ConfigError: an option has an unusable type or value; the message names it.
    """

    # One line of --help each; the docstring above says more.
    queues: tuple[str, ...] = field(
        default=DEFAULT_QUEUES,
        metadata=_option(
            Names(), "queues to serve, comma-separated; repeatable", flag="--queue", repeatable=True
        ),
    )
    concurrency: int = field(
        default=DEFAULT_CONCURRENCY,
        metadata=_option(Integer(1, MAX_CONCURRENCY), "jobs run at once"),
    )
    prefetch: int | None = field(
        default=None,
        metadata=_option(
            AutoInteger(0, MAX_CONCURRENCY),
            "jobs claimed ahead of free slots, so a freed slot starts its next job at once; "
            "'auto' follows the handlers' pace and the queue's depth",
        ),
    )
    lease: timedelta = field(
        default=DEFAULT_LEASE,
        metadata=_option(
            Duration(minimum=MIN_LEASE),
            "how long a claim holds a job; renewed every third of it while the job runs",
        ),
    )
    poll_interval: timedelta = field(
        default=DEFAULT_POLL_INTERVAL,
        metadata=_option(
            Duration(minimum=10 * _MS), "look for due jobs at least this often, notified or not"
        ),
    )
    grace_period: timedelta = field(
        default=DEFAULT_GRACE_PERIOD,
        metadata=_option(
            Duration(), "on stop, how long running jobs may finish before they are handed back"
        ),
    )
    start_timeout: timedelta = field(
        default=DEFAULT_START_TIMEOUT,
        metadata=_option(
            Duration(),
            "at start, how long to retry a database that is unavailable (restarting) "
            "before exiting 1",
        ),
    )
    burst: bool = field(default=False, metadata=_option(Boolean(), "run what is due, then exit 0"))
    listen: bool = field(
        default=True, metadata=_option(Boolean(), "wake on NOTIFY (--no-listen: poll only)")
    )
    listen_url: str | None = field(
        default=None,
        repr=False,  # it may hold a password
        metadata=_option(
            DatabaseUrl(),
            "a URL reaching PostgreSQL directly (not through PgBouncer), for the LISTEN "
            "connection and the maintenance leader's lock",
            shown="the database URL",
        ),
    )
    maintenance: bool = field(
        default=True,
        metadata=_option(
            Boolean(),
            "enqueue periodic jobs and take part in the leader election for pruning and "
            "the lease sweep",
        ),
    )
    maintenance_interval: timedelta = field(
        default=DEFAULT_MAINTENANCE_INTERVAL,
        metadata=_option(
            Duration(minimum=10 * _MS),
            "how often maintenance runs (and how soon a new leader takes over)",
        ),
    )
    retain_done: timedelta | None = field(
        default=DEFAULT_RETAIN_DONE,
        metadata=_option(
            Duration(forever=True),
            "the leader deletes done and cancelled jobs finished longer ago; 'forever' keeps them",
        ),
    )
    retain_failed: timedelta | None = field(
        default=DEFAULT_RETAIN_FAILED,
        metadata=_option(
            Duration(forever=True),
            "the leader deletes failed jobs finished longer ago; 'forever' keeps them",
        ),
    )
    vacuum: bool = field(
        default=True,
        metadata=_option(
            Boolean(),
            "vacuum the jobs table during deep drains, not waiting for autovacuum "
            "(--no-vacuum: autovacuum alone)",
        ),
    )
    where: str | ColumnElement[bool] | Sequence[ColumnElement[bool]] | None = field(
        default=None,
        metadata=_option(
            Condition(),
            "claim only jobs matching this SQL boolean expression over the job's columns "
            "(worker affinity), e.g. \"payload->>'region' = 'eu'\"",
        ),
    )

    fair: tuple[str, ...] = field(
        default=(),
        metadata=_option(
            Names(empty=True),
            "queues whose jobs are claimed fairly across their keys (a flooding key gets "
            "its share, not the whole worker), comma-separated; repeatable",
            repeatable=True,
        ),
    )
    key_weights: tuple[tuple[str, int], ...] = field(
        default=(),
        metadata=_option(
            Weights(),
            "weights of keys in fair queues, KEY=N comma-separated (others weigh 1); repeatable",
            flag="--key-weight",
            repeatable=True,
        ),
    )
    executor: str = field(
        default="thread",
        metadata=_option(
            Choice(EXECUTORS),
            "where sync handlers run: the worker's threads, or a pool of child processes "
            "(CPU-bound handlers, hard timeouts)",
        ),
    )
    processes: int | None = field(
        default=None,
        metadata=_option(
            AutoInteger(1, MAX_PROCESSES),
            "child processes of the process executor; 'auto': one per CPU",
        ),
    )
    max_jobs_per_child: int = field(
        default=0,
        metadata=_option(
            Integer(0, 2**31 - 1),
            "replace a child process after this many jobs (process executor); 0: never",
        ),
    )
    max_memory_per_child: int = field(
        default=0,
        metadata=_option(
            Integer(0, 2**31 - 1),
            "replace a child process whose resident memory exceeds this many MiB after a "
            "job (process executor); 0: no ceiling",
            metavar="MIB",
        ),
    )

    def __post_init__(self) -> None:
        for option in WORKER_OPTIONS:
            value = getattr(self, option.name)
            checked = option.domain.check(value, option.name)
            if checked is not value:  # normalised, e.g. one queue name -> a tuple
                object.__setattr__(self, option.name, checked)

    @classmethod
    def from_options(cls, base: WorkerConfig | None = None, **options: Any) -> WorkerConfig:
        """Return *base* (or the defaults) with *options* replaced, validated.

        Raises:
            ConfigError: an option is unknown or has an unusable value.
        """
        check_options(options)
        current = {f.name: getattr(base, f.name) for f in fields(cls)} if base else {}
        return cls(**{**current, **options})

    @property
    def heartbeat_interval(self) -> timedelta:
        """How often leases are renewed: a third of the lease, so two renewals may fail
        (a database blip, a busy host) before the lease runs out."""
        return self.lease / 3


def check_options(given: Iterable[str], *, also: Iterable[str] = ()) -> None:
    """Refuse names in *given* that are not worker options (nor in *also*, the other
    keyword arguments the caller takes).

    Raises:
        ConfigError: one line naming each unknown option, the closest known name
            (``did you mean 'concurrency'?``) and every declared option.
    """
    known = [option.name for option in WORKER_OPTIONS]
    candidates = [*known, *also]
    unknown = sorted(set(given) - set(candidates))
    if not unknown:
        return
    named = []
    for name in unknown:
        import difflib  # a misspelt name only: not imported by a worker

        close = difflib.get_close_matches(name, candidates, n=1)
        named.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    raise ConfigError(
        f"unknown worker option(s): {', '.join(named)}; the options are {', '.join(sorted(known))}"
    )


#: The options of :class:`WorkerConfig`, in field order, as declared on its fields: what
#: ``sqlaq-worker`` turns into flags, ``SQLAQ_*`` variables and ``--help``.
WORKER_OPTIONS: tuple[Option, ...] = tuple(
    replace(f.metadata[_OPTION], name=f.name, default=f.default) for f in fields(WorkerConfig)
)
