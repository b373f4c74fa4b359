"""Vacuuming the jobs table during a deep drain, from the worker draining it.

Every claim and every completion leaves a dead row version of its job, and the claim's
index scan reads past the entries of the jobs claimed before it until a vacuum removes
them, so a long drain slows as they pile up. The table's autovacuum settings (the
revisions: after ~1 % churn) start a vacuum at once, but autovacuum's launcher looks at
a database only every ``autovacuum_naptime`` (one minute by default): a burst of a
million jobs drained in under a minute ran at half its pace by its end
(``bench/RESULTS.md``, "Scale").

So the worker that claims looks too: after :data:`CHECK_EVERY` jobs claimed since it
last looked, it reads the table's dead and live row versions from the statistics, and
when the dead ones are at least :data:`MIN_DEAD_ROWS` and a tenth of the live ones, it
runs ``VACUUM (SKIP_LOCKED)`` on a connection of its own, in a daemon thread, while its
claims go on. A vacuum of a million-row table with 200,000 dead versions takes about a
tenth of a second on the benchmark's machine.

A snapshot held open elsewhere (a long transaction, a replication slot) keeps every
version that died after it: a vacuum then removes nothing, yet reads the whole table,
which grows with the drain. So after each vacuum the worker reads what it could not
remove (the dead count the vacuum left in the statistics); when that is at least half
of what it found dead, the next vacuum waits until there are twice as many dead versions
as it left (:data:`HELD_GROWTH`): while the snapshot is held, vacuums come at 100,000,
200,000, 400,000, ... dead versions rather than every :data:`CHECK_EVERY` jobs, and the
first one after the snapshot is gone removes them all and ends the wait.

``SKIP_LOCKED``: while autovacuum or another worker is vacuuming the table, this one
skips at once (and learns nothing of what it would have left). Only the table's owner,
a superuser, or (PostgreSQL 17 and later) a role granted ``MAINTAIN`` on it may vacuum
it: a worker whose role may not finds it out at its first look, says so once, and
leaves the table to autovacuum. ``--no-vacuum`` (``WorkerConfig(vacuum=False)``) turns
it off. Nothing here ever stops the worker: an
error is logged and the next look tries again.
"""

from __future__ import annotations

import logging
import threading
from time import monotonic

from sqlalchemy import Engine

from sqlaq import queries
from sqlaq.transient import describe

__all__ = [
    "CHECK_EVERY",
    "DEAD_FRACTION",
    "HELD_GROWTH",
    "MIN_DEAD_ROWS",
    "DrainVacuum",
    "needs_vacuum",
]

_log = logging.getLogger(__name__)

#: Jobs claimed by this worker between two looks at the table's dead row versions.
CHECK_EVERY = 50_000
#: Vacuum only when the table has at least this many dead row versions...
MIN_DEAD_ROWS = 100_000
#: ... and at least this fraction of its live ones.
DEAD_FRACTION = 0.1
#: After a vacuum that could not remove half of the dead versions it found (a snapshot
#: held elsewhere keeps them), the next waits for this many times the versions it left.
HELD_GROWTH = 2


def needs_vacuum(dead: int, live: int) -> bool:
    """Whether a table with *dead* and *live* row versions is worth a vacuum now."""
    return dead >= MIN_DEAD_ROWS and dead >= DEAD_FRACTION * live


class DrainVacuum:
    """Counts the jobs a worker claims and vacuums the jobs table when a deep drain has
    left enough dead row versions (see the module docstring).

    Args:
        engine: The queue's database; a look or a vacuum takes one of its connections
            for its span.
        check_every: Jobs claimed between two looks; None: :data:`CHECK_EVERY`.

    Attributes:
        vacuums: How many vacuums this worker has run (for tests and logs).
        idle: Set while no look or vacuum runs.
        waits_for: The dead row versions the next vacuum waits for, beyond
            :func:`needs_vacuum`: 0, or :data:`HELD_GROWTH` times what the last vacuum
            could not remove when that was at least half of what it found.
    """

    def __init__(self, engine: Engine, *, check_every: int | None = None) -> None:
        self._engine = engine
        self._check_every = CHECK_EVERY if check_every is None else check_every
        self._since = 0
        self._refused = False
        self.vacuums = 0
        self.waits_for = 0
        self.idle = threading.Event()
        self.idle.set()

    def claimed(self, count: int) -> None:
        """*count* jobs were just claimed (the claiming thread calls it): look at the
        table once enough have been, unless a look or a vacuum still runs."""
        self._since += count
        if self._since < self._check_every or self._refused or not self.idle.is_set():
            return
        self._since = 0
        self.idle.clear()
        threading.Thread(target=self._look, name="sqlaq-vacuum", daemon=True).start()

    def _look(self) -> None:
        try:
            with self._engine.connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                dead, live, allowed, ended = conn.execute(queries.vacuum_need_stmt()).one()
                if not allowed:
                    self._refused = True
                    _log.info(
                        "not vacuuming the jobs table during drains: this role neither owns "
                        "it nor holds MAINTAIN on it (PostgreSQL 17+); autovacuum alone "
                        "keeps it (see README, Autovacuum)"
                    )
                    return
                if not needs_vacuum(dead, live) or dead < self.waits_for:
                    return
                started = monotonic()
                conn.execute(queries.vacuum_stmt())
                self.vacuums += 1
                kept, _, _, now_ended = conn.execute(queries.vacuum_need_stmt()).one()
                if now_ended > ended:  # not skipped (SKIP_LOCKED), or another one ended
                    # Half or more still there: a snapshot held elsewhere keeps them.
                    self.waits_for = HELD_GROWTH * kept if 2 * kept >= dead else 0
                _log.info(
                    "jobs table vacuumed during a drain",
                    extra={
                        "dead_rows": dead,
                        "not_removable": kept,
                        "seconds": round(monotonic() - started, 3),
                    },
                )
        except Exception as exc:
            _log.warning("could not vacuum the jobs table, trying again later: %s", describe(exc))
        finally:
            self.idle.set()
