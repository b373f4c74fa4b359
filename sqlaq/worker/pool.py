"""How many connections of the engine's pool each part of a worker holds at most: the
one place they are counted. ``sqlaq-worker`` sizes its engine's pool from it, and a
worker refuses at start an engine whose pool cannot hold them all (its parts would
otherwise wait on each other for a connection, for the pool's timeout). No SQL.

The LISTEN connection is not counted: it is made outside the pool.
"""

from __future__ import annotations

from typing import Any

from sqlaq.config import WorkerConfig
from sqlaq.errors import ConfigError
from sqlaq.registry import Registry

__all__ = ["PoolNeeds", "capacity", "check", "needs", "sized"]

#: The claim connection, held, plus one for a limited kind's claim, a hand-back or the
#: poll's look behind the claim bounds (each brief: one may wait for another to end).
CLAIMS = 2
#: The writer's connection, held.
WRITER = 1
#: The maintenance thread: the leader's lock (held while it leads, on the pool unless
#: ``listen_url`` gives it a direct connection), plus one for a round.
LEADER_LOCK = 1
MAINTENANCE_ROUND = 1
#: A drain's vacuum look, with ``vacuum`` on.
VACUUM = 1

#: Each part's connections, by name: what a refusal lists.
PoolNeeds = dict[str, int]


def needs(config: WorkerConfig, *, transactional: int = 0) -> PoolNeeds:
    """The connections each part of a worker with *config* holds at most at once;
    *transactional* is how many transactional (sync) handlers may run at once, each
    holding one for its session. Handlers calling ``current_job().extend_lease()``
    take one each for that moment; they are not counted here (``sqlaq-worker`` lets
    its pool overflow by the concurrency for them)."""
    parts: PoolNeeds = {"claims": CLAIMS, "writer": WRITER}
    if not config.burst:
        parts["maintenance"] = MAINTENANCE_ROUND + (0 if config.listen_url else LEADER_LOCK)
    if config.vacuum:
        parts["vacuum"] = VACUUM
    if transactional:
        parts["transactional handlers"] = transactional
    return parts


def capacity(engine: Any) -> int | None:
    """How many connections *engine*'s pool gives at most; None when unbounded (a
    NullPool, a StaticPool, an overflow of -1)."""
    pool = getattr(engine, "pool", None)
    size = getattr(pool, "size", None)
    overflow = getattr(pool, "_max_overflow", None)
    if not callable(size) or not isinstance(overflow, int) or overflow < 0:
        return None
    return int(size()) + overflow


def check(engine: Any, parts: PoolNeeds) -> None:
    """Refuse *engine* if its pool cannot hold *parts* at once.

    Raises:
        ConfigError: the pool is too small, naming each part and its connections.
    """
    held = capacity(engine)
    needed = sum(parts.values())
    if held is None or held >= needed:
        return
    listed = ", ".join(f"{name} {count}" for name, count in parts.items())
    raise ConfigError(
        f"the engine's pool holds at most {held} connections, but this worker's parts "
        f"need {needed} at once ({listed}): create_engine(..., pool_size={needed}) "
        "or a larger max_overflow"
    )


def sized(config: WorkerConfig, registry: Registry) -> tuple[int, int]:
    """``(pool_size, max_overflow)`` for an engine made for a worker of *registry* with
    *config*: every part's connections (:func:`needs`, with a session per running
    handler when sync transactional handlers exist), and an overflow of one per running
    handler for ``current_job().extend_lease()``."""
    transactional = any(h.transaction and not h.is_async for h in registry)
    parts = needs(config, transactional=config.concurrency if transactional else 0)
    return sum(parts.values()), config.concurrency
