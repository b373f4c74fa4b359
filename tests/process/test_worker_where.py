"""``sqlaq-worker --where`` (and ``SQLAQ_WHERE``): a worker process serving a subset of its
queue; an expression the jobs table refuses is one line and exit 2."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine
from workerkit import rows, worker_processes

import sqlaq

pytestmark = pytest.mark.timeout(120)


def _enqueue(engine: Engine, regions: list[str]) -> None:
    with engine.begin() as conn:
        sqlaq.enqueue_many(conn, [sqlaq.NewJob("noop", {"region": r}) for r in regions])


def _by_region(engine: Engine) -> dict[tuple[str, str], int]:
    found = rows(
        engine,
        "SELECT payload->>'region' AS region, status, count(*) AS n FROM sqlaq_jobs GROUP BY 1, 2",
    )
    return {(r.region, r.status): r.n for r in found}


def test_where_flag_and_variable_narrow_a_worker_process(
    committed: Engine, database_url: str
) -> None:
    _enqueue(committed, ["eu"] * 10 + ["us"] * 10 + ["ap"] * 10)
    with worker_processes(database_url) as start:
        flag = start("--burst", "--log-level", "warning", "--where", "payload->>'region' = 'eu'")
        assert flag.wait(60) == 0, flag.output()
        assert _by_region(committed) == {
            ("eu", "done"): 10,
            ("us", "queued"): 10,
            ("ap", "queued"): 10,
        }
        variable = start(
            "--burst", "--log-level", "warning", SQLAQ_WHERE="payload->>'region' IN ('us')"
        )
        assert variable.wait(60) == 0, variable.output()
        assert _by_region(committed) == {
            ("eu", "done"): 10,
            ("us", "done"): 10,
            ("ap", "queued"): 10,
        }


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--where", "nope = 1"], {}, 'column "nope" does not exist'),
        ([], {"SQLAQ_WHERE": "payload = 5"}, "operator does not exist: jsonb = integer"),
        (["--where", "kind LIKE"], {}, "syntax error"),
    ],
    ids=["column", "type-from-variable", "syntax"],
)
def test_a_where_the_table_refuses_is_one_line_exit_2(
    committed: Engine, database_url: str, args: list[str], env: dict[str, str], message: str
) -> None:
    _enqueue(committed, ["eu"])
    with worker_processes(database_url) as start:
        worker = start("--burst", "--log-level", "warning", *args, **env)
        assert worker.wait(60) == 2, worker.output()
        lines = worker.output().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("sqlaq-worker: error: where "), lines
    assert "does not run against the jobs table" in lines[0]
    assert message in lines[0]
    assert _by_region(committed) == {("eu", "queued"): 1}
