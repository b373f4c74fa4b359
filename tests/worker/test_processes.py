"""The process executor (``executor="process"``): sync handlers in child processes.

The handlers live in tests/process_app.py (a child imports them by module and name).
Most return their pid, which the worker writes as the job's result: what ran where is
read back from the table. Handlers that must be seen running create a file named in
their payload; nothing here sleeps to synchronise.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from time import monotonic
from typing import Any

import pytest
import sqlalchemy
from process_app import registry
from sqlalchemy import Engine
from workerkit import Recorder, enqueue, job, running, wait_until

import sqlaq
from sqlaq.errors import ConfigError

pytestmark = pytest.mark.timeout(90)

FAST = {"poll_interval": timedelta(milliseconds=100), "maintenance": False}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not reaped yet) is dead too
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@contextmanager
def process_worker(engine: Engine, recorder: Recorder, **options: Any) -> Iterator[sqlaq.Worker]:
    options = {**FAST, "executor": "process", **options}
    worker = sqlaq.Worker(engine, registry, on_job_finished=recorder.finished, **options)
    with running(worker):
        yield worker


def result_of(engine: Engine, job_id: int) -> Any:
    return job(engine, job_id).result


def test_a_cpu_bound_handler_runs_in_another_process(committed: Engine) -> None:
    recorder = Recorder()
    with process_worker(committed, recorder, processes=2) as worker:
        ids = [enqueue(committed, "cpu", {"ms": 2}) for _ in range(6)]
        recorder.wait_for(6)
        children = worker._processes.pids if worker._processes else []
    pids = {result_of(committed, i) for i in ids}
    assert all(job(committed, i).status == "done" for i in ids)
    assert os.getpid() not in pids
    assert pids <= set(children)
    assert 1 <= len(pids) <= 2
    assert worker._processes is not None
    assert worker._processes.size == 2
    assert not any(alive(pid) for pid in children)  # the worker's close ended them


@pytest.mark.parametrize("kind", ["sleep", "busy"])
def test_a_handler_stuck_past_its_timeout_is_killed_and_its_slot_runs_the_next_job(
    committed: Engine, kind: str
) -> None:
    recorder = Recorder()
    with process_worker(committed, recorder, processes=1) as worker:
        started = monotonic()
        stuck = enqueue(committed, kind)
        pool = worker._processes
        assert pool is not None
        stuck_pid = wait_until(lambda: pool.pids, 30, "the child to start")[0]
        after = enqueue(committed, "pid")
        results = recorder.wait_for(2, timeout=30)
        elapsed = monotonic() - started
    first = next(r for r in results if r.job_id == stuck)
    assert first.status == sqlaq.JobStatus.QUEUED  # retried per its policy
    assert first.error == "sqlaq.errors.JobTimeoutError: timed out after 1s"
    assert job(committed, stuck).last_error == first.error
    assert job(committed, after).status == "done"
    assert result_of(committed, after) != stuck_pid  # a new child in the freed slot
    assert not alive(stuck_pid)
    assert elapsed < 20  # not the handler's hour, nor a lease's wait


def test_what_a_killed_handler_started_is_killed_with_it(committed: Engine, tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    recorder = Recorder()
    with process_worker(committed, recorder, processes=1):
        enqueue(committed, "spawner", {"pid_file": str(pid_file)})
        (result,) = recorder.wait_for(1)
    assert result.error == "sqlaq.errors.JobTimeoutError: timed out after 1s"
    grandchild = int(pid_file.read_text())
    # (not this process's child: the init process reaps it once it is killed)
    wait_until(lambda: not alive(grandchild), 10, "the handler's own process to end")


def test_a_job_s_deadline_does_not_count_its_child_s_start(
    committed: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROCESS_APP_IMPORT_SECONDS", "1.5")  # the children's import
    recorder = Recorder()
    # The first child is ready before the worker claims; the second replaces it after
    # one job, and the second job waits for it to import.
    with process_worker(committed, recorder, processes=1, max_jobs_per_child=1):
        ids = [enqueue(committed, "quick") for _ in range(2)]  # a 1 s timeout each
        results = recorder.wait_for(2)
    assert [r.status for r in results] == [sqlaq.JobStatus.DONE] * 2, results
    first, second = (result_of(committed, i) for i in ids)
    assert os.getpid() != first != second != os.getpid()


def test_a_child_is_replaced_after_max_jobs_per_child(committed: Engine) -> None:
    recorder = Recorder()
    # (concurrency 1: the jobs run in the order of their ids)
    with process_worker(committed, recorder, processes=1, max_jobs_per_child=2, concurrency=1):
        ids = [enqueue(committed, "pid") for _ in range(5)]
        recorder.wait_for(5)
    pids = [result_of(committed, i) for i in sorted(ids)]
    assert sorted(Counter(pids).values()) == [1, 2, 2], pids
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]


def test_a_child_over_max_memory_per_child_is_replaced_after_its_job(committed: Engine) -> None:
    recorder = Recorder()
    with process_worker(committed, recorder, processes=1, max_memory_per_child=200):
        first = enqueue(committed, "pid")
        recorder.wait_for(1)
        hog = enqueue(committed, "hog", {"mib": 250})
        recorder.wait_for(2)
        after = enqueue(committed, "pid")
        recorder.wait_for(3)
    assert job(committed, hog).status == "done"  # never cut short for it
    assert result_of(committed, first) == result_of(committed, hog)
    assert result_of(committed, after) != result_of(committed, hog)


@pytest.mark.parametrize(
    ("how", "said"),
    [("kill", "was killed by SIGKILL"), ("exit", "exited with code 3")],
)
def test_a_child_that_dies_fails_its_job_and_the_others_go_on(
    committed: Engine, how: str, said: str
) -> None:
    recorder = Recorder()
    with process_worker(committed, recorder, processes=2):
        ids = [enqueue(committed, "cpu", {"ms": 20}) for _ in range(3)]
        dead = enqueue(committed, "die", {"how": how}, max_attempts=1)
        ids += [enqueue(committed, "cpu", {"ms": 20}) for _ in range(3)]
        recorder.wait_for(7)
    row = job(committed, dead)
    assert row.status == "failed"
    assert row.last_error.startswith("sqlaq.errors.HandlerProcessDied: the handler's process (pid ")
    assert said in row.last_error
    assert all(job(committed, i).status == "done" for i in ids)


def test_errors_cross_the_pipe_with_their_traceback_and_policy(committed: Engine) -> None:
    recorder = Recorder()
    with process_worker(committed, recorder, processes=2):
        fail = enqueue(committed, "fail", {"n": 7}, max_attempts=1)
        retried = enqueue(committed, "retried")
        snoozed = enqueue(committed, "snooze")
        bad_error = enqueue(committed, "unsendable_error", max_attempts=1)
        bad_result = enqueue(committed, "unsendable_result")
        recorder.wait_for(5)
    row = job(committed, fail)
    assert row.status == "failed"
    assert row.last_error.startswith("ValueError: boom 7\n\nTraceback")
    assert 'process_app.py", line' in row.last_error
    assert "in fail" in row.last_error
    row = job(committed, retried)  # retry=ValueError: the policy saw the exception's type
    assert (row.status, row.attempts) == ("queued", 1)
    row = job(committed, snoozed)
    assert (row.status, row.attempts, row.last_error) == ("queued", 0, None)
    row = job(committed, bad_error)
    assert row.status == "failed"
    assert "raised an exception that cannot be sent from its process" in row.last_error
    assert "Unsendable: holds a lock" in row.last_error
    row = job(committed, bad_result)
    assert row.status == "failed"
    assert "return value cannot be sent from its process" in row.last_error


def test_current_job_in_a_child(committed: Engine) -> None:
    recorder = Recorder()
    with process_worker(committed, recorder, processes=1):
        job_id = enqueue(committed, "context", {"a": 1}, queue="default")
        recorder.wait_for(1)
    seen = result_of(committed, job_id)
    assert seen["id"] == job_id
    assert (seen["kind"], seen["queue"], seen["attempt"]) == ("context", "default", 1)
    assert seen["payload"] == {"a": 1}
    assert seen["attempted_at"]
    assert not seen["cancelled"]
    assert seen["pid"] != os.getpid()
    assert (
        "extend_lease() is not available to a handler running in a child" in (seen["extend_lease"])
    )


def files(tmp_path: Path, name: str) -> dict[str, str]:
    return {
        "started": str(tmp_path / f"{name}.started"),
        "release": str(tmp_path / f"{name}.release"),
    }


def test_a_stopping_worker_waits_for_a_child_within_its_grace_period(
    committed: Engine, tmp_path: Path
) -> None:
    recorder = Recorder()
    worker = sqlaq.Worker(
        committed, registry, on_job_finished=recorder.finished, executor="process", **FAST
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        payload = files(tmp_path, "graceful")
        job_id = enqueue(committed, "wait_file", payload)
        wait_until(lambda: Path(payload["started"]).exists(), 30, "the handler to start")
        worker.stop()
        assert not worker.stopped.wait(0.3)  # it waits for the running job
        Path(payload["release"]).touch()
        assert worker.stopped.wait(30)
    finally:
        worker.stop(now=True)
        thread.join(30)
    assert job(committed, job_id).status == "done"


def test_past_the_grace_period_the_job_is_handed_back_and_its_child_killed(
    committed: Engine, tmp_path: Path
) -> None:
    recorder = Recorder()
    worker = sqlaq.Worker(
        committed,
        registry,
        on_job_finished=recorder.finished,
        executor="process",
        grace_period=timedelta(0),
        **FAST,
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        payload = files(tmp_path, "handed")
        job_id = enqueue(committed, "wait_file", payload)
        wait_until(lambda: Path(payload["started"]).exists(), 30, "the handler to start")
        child = int(Path(payload["started"]).read_text())
        worker.stop()
        assert worker.stopped.wait(30)
    finally:
        worker.stop(now=True)
        thread.join(30)
    row = job(committed, job_id)
    assert (row.status, row.attempts) == ("queued", 0)
    wait_until(lambda: not alive(child), 10, "the child to be killed")


def test_a_cancelled_job_s_child_is_killed(committed: Engine, tmp_path: Path) -> None:
    recorder = Recorder()
    with process_worker(committed, recorder, processes=1):
        payload = files(tmp_path, "cancel")
        job_id = enqueue(committed, "wait_file", payload)
        wait_until(lambda: Path(payload["started"]).exists(), 30, "the handler to start")
        child = int(Path(payload["started"]).read_text())
        with committed.begin() as conn:
            sqlaq.cancel(conn, job_id)
        (result,) = recorder.wait_for(1)
        after = enqueue(committed, "pid")
        recorder.wait_for(2)
    assert result.status == sqlaq.JobStatus.CANCELLED
    assert job(committed, job_id).status == "cancelled"
    assert not alive(child)
    assert job(committed, after).status == "done"


# -- a job waiting in a busy child's pipe (after a short job, the next is sent at once) --


def waiting_in_pipes(worker: sqlaq.Worker) -> list[int]:
    """For each child: how many jobs were sent to it and not answered (1 running, 2:
    one more waits in its pipe)."""
    pool = worker._processes
    assert pool is not None
    with pool._lock:
        return [len(child.runs) for child in pool._children]


def cancelled_in_pipes(worker: sqlaq.Worker) -> list[bool]:
    """For each child with a job waiting in its pipe: whether that job is known here to
    be cancelled."""
    pool = worker._processes
    assert pool is not None
    with pool._lock:
        return [c.runs[1].run.context.cancelled for c in pool._children if len(c.runs) > 1]


@contextmanager
def one_behind_another(
    committed: Engine,
    tmp_path: Path,
    recorder: Recorder,
    front: str = "wait_file",
    timeout: timedelta | None = None,
    **options: Any,
) -> Iterator[tuple[sqlaq.Worker, dict[str, Any], int]]:
    """A worker with one child, which has run a short job; then a job (*front*, its
    payload's files in tmp_path, its own *timeout*) that runs until released. Yields
    the worker, the front's payload (and id) and its child's pid: the test enqueues
    the job that waits in the child's pipe behind it."""
    payload: dict[str, Any] = {**files(tmp_path, "front"), "mib": 250}
    with process_worker(committed, recorder, processes=1, **options) as worker:
        enqueue(committed, "pid")  # short: the child's next jobs are sent at once
        recorder.wait_for(1)
        front_id = enqueue(committed, front, payload, timeout=timeout)
        wait_until(lambda: Path(payload["started"]).exists(), 30, "the front job to start")
        payload["id"] = front_id
        yield worker, payload, int(Path(payload["started"]).read_text())


def test_a_job_behind_one_that_times_out_runs_in_the_next_child(
    committed: Engine, tmp_path: Path
) -> None:
    recorder = Recorder()
    with one_behind_another(committed, tmp_path, recorder, timeout=timedelta(seconds=3)) as (
        worker,
        front,
        child,
    ):
        notes = tmp_path / "notes"
        behind = enqueue(committed, "note", {"notes": str(notes)})
        wait_until(lambda: waiting_in_pipes(worker) == [2], 30, "the job to wait in the pipe")
        results = recorder.wait_for(3)  # the front is never released: killed at 3 s
    assert not alive(child)
    by_id = {r.job_id: r for r in results}
    assert by_id[front["id"]].status == sqlaq.JobStatus.QUEUED  # timed out, retried
    assert "timed out" in (by_id[front["id"]].error or "")
    assert job(committed, behind).status == "done"
    assert job(committed, behind).attempts == 1
    assert result_of(committed, behind) not in (child, None)
    assert notes.read_text().split() == [
        str(result_of(committed, behind))
    ]  # never in the killed one


def test_a_child_over_max_memory_does_not_start_the_job_waiting_in_its_pipe(
    committed: Engine, tmp_path: Path
) -> None:
    recorder = Recorder()
    with one_behind_another(
        committed, tmp_path, recorder, front="hog_file", max_memory_per_child=200
    ) as (worker, front, child):
        notes = tmp_path / "notes"
        behind = enqueue(committed, "note", {"notes": str(notes)})
        wait_until(lambda: waiting_in_pipes(worker) == [2], 30, "the job to wait in the pipe")
        Path(front["release"]).touch()
        recorder.wait_for(3)
    assert result_of(committed, front["id"]) == child
    assert job(committed, behind).status == "done"
    assert result_of(committed, behind) != child  # a new child ran it
    assert notes.read_text().split() == [str(result_of(committed, behind))]  # it alone


def test_a_cancelled_job_waiting_in_a_pipe_never_runs_to_its_end(
    committed: Engine, tmp_path: Path
) -> None:
    recorder = Recorder()
    with one_behind_another(committed, tmp_path, recorder) as (worker, front, child):
        behind = enqueue(committed, "pid")
        wait_until(lambda: waiting_in_pipes(worker) == [2], 30, "the job to wait in the pipe")
        with committed.begin() as conn:
            sqlaq.cancel(conn, behind)
        # The worker has heard of the cancel (its NOTIFY) before the job can start:
        # released earlier, the child may start and finish it first (CI saw it once).
        wait_until(lambda: cancelled_in_pipes(worker) == [True], 30, "the cancel to arrive")
        Path(front["release"]).touch()
        results = recorder.wait_for(3)
        after = enqueue(committed, "pid")
        recorder.wait_for(4)
    by_id = {r.job_id: r for r in results}
    assert by_id[front["id"]].status == sqlaq.JobStatus.DONE
    assert by_id[behind].status == sqlaq.JobStatus.CANCELLED
    assert job(committed, behind).status == "cancelled"
    assert not alive(child)  # killed as it started the cancelled job
    assert result_of(committed, after) != child


def test_a_job_waiting_in_a_pipe_has_its_deadline_from_its_start(
    committed: Engine, tmp_path: Path
) -> None:
    recorder = Recorder()
    with one_behind_another(committed, tmp_path, recorder) as (worker, front, child):
        behind = enqueue(committed, "quick")  # a 1 s timeout
        wait_until(lambda: waiting_in_pipes(worker) == [2], 30, "the job to wait in the pipe")
        queued = monotonic()
        # Time is the point here: the job waits past its timeout before it starts.
        wait_until(lambda: monotonic() - queued > 1.5, 5, "1.5 s to pass")
        Path(front["release"]).touch()
        results = recorder.wait_for(3)
    assert {r.job_id: r.status for r in results}[behind] == sqlaq.JobStatus.DONE
    assert result_of(committed, behind) == child


def test_no_job_waits_in_the_pipe_of_a_child_whose_last_job_was_long(
    committed: Engine, tmp_path: Path
) -> None:
    recorder = Recorder()
    with process_worker(committed, recorder, processes=1) as worker:
        enqueue(committed, "cpu", {"ms": 150})  # longer than PIPELINE_SECONDS
        recorder.wait_for(1)
        front = files(tmp_path, "front")
        enqueue(committed, "wait_file", front)
        wait_until(lambda: Path(front["started"]).exists(), 30, "the front job to start")
        behind = enqueue(committed, "pid")
        pool = worker._processes
        assert pool is not None
        wait_until(lambda: pool._waiting, 30, "the job to wait for a free child")
        assert waiting_in_pipes(worker) == [1]
        Path(front["release"]).touch()
        recorder.wait_for(3)
    assert job(committed, behind).status == "done"


def test_a_finished_job_is_written_while_another_child_still_runs(
    committed: Engine, tmp_path: Path
) -> None:
    recorder = Recorder()
    with process_worker(committed, recorder, processes=2) as worker:
        long = files(tmp_path, "long")
        enqueue(committed, "wait_file", long)
        wait_until(lambda: Path(long["started"]).exists(), 30, "the long job to start")
        quick = enqueue(committed, "pid")
        (result,) = recorder.wait_for(1)  # (answers are reported together, a few ms apart)
        assert result.job_id == quick
        assert job(committed, quick).status == "done"
        assert sorted(waiting_in_pipes(worker)) == [0, 1]  # the long one still runs
        Path(long["release"]).touch()
        recorder.wait_for(2)


def test_per_handler_executor_beside_threads(committed: Engine) -> None:
    mixed = sqlaq.Registry()
    mixed.add("in_child", registry.get("pid").func, executor="process")  # type: ignore[union-attr]
    mixed.add("on_thread", registry.get("pid").func)  # type: ignore[union-attr]
    recorder = Recorder()
    worker = sqlaq.Worker(committed, mixed, on_job_finished=recorder.finished, **FAST)
    assert worker.config.concurrency == sqlaq.WorkerConfig().concurrency  # not all in children
    assert sqlaq.Worker(committed, mixed, concurrency=1, **FAST)._processes.size == 1  # type: ignore[union-attr]
    with running(worker):
        child = enqueue(committed, "in_child")
        here = enqueue(committed, "on_thread")
        recorder.wait_for(2)
    assert result_of(committed, here) == os.getpid()
    assert result_of(committed, child) != os.getpid()


# -- refused: one line ----------------------------------------------------------------


def test_executor_process_is_refused_to_async_and_transactional_handlers() -> None:
    refused = sqlaq.Registry()

    async def coroutine(payload: dict[str, Any]) -> None: ...

    def transactional(payload: dict[str, Any], session: Any) -> None: ...

    with pytest.raises(ConfigError, match="an async handler runs in the worker's process"):
        refused.add("a", coroutine, executor="process")
    with pytest.raises(ConfigError, match="a transactional handler runs in the worker's"):
        refused.add("t", transactional, executor="process")
    with pytest.raises(ConfigError, match=r'executor of .x. must be "thread", "process"'):
        refused.add("x", coroutine, executor="processes")  # type: ignore[typeddict-item]
    with pytest.raises(ConfigError, match="did you mean 'executor'"):
        refused.add("y", coroutine, executr="process")  # type: ignore[call-arg]


def test_a_handler_a_child_cannot_import_is_refused_when_the_worker_is_made(
    committed: Engine,
) -> None:
    local = sqlaq.Registry()

    @local.handler("nested", executor="process")
    def nested(payload: dict[str, Any]) -> None: ...

    with pytest.raises(ConfigError) as caught:
        sqlaq.Worker(committed, local, **FAST)
    message = str(caught.value)
    assert "\n" not in message
    assert "the handler of 'nested' runs in a child process" in message
    assert "define it at module level" in message
    with pytest.raises(ConfigError, match="executor: invalid choice 'fork'"):
        sqlaq.Worker(committed, registry, executor="fork", **FAST)
    with pytest.raises(ConfigError, match="processes must be between 1 and 1024"):
        sqlaq.Worker(committed, registry, processes=0, **FAST)


def test_async_and_transactional_handlers_stay_in_the_worker_s_process(
    committed: Engine,
) -> None:
    both = sqlaq.Registry()
    seen: dict[str, int] = {}

    @both.handler("coroutine")
    async def coroutine(payload: dict[str, Any]) -> None:
        seen["async"] = os.getpid()

    @both.handler("in_transaction")
    def in_transaction(payload: dict[str, Any], session: Any) -> None:
        session.execute(sqlalchemy.text("SELECT 1"))
        seen["transaction"] = os.getpid()

    recorder = Recorder()
    worker = sqlaq.Worker(
        committed, both, on_job_finished=recorder.finished, executor="process", **FAST
    )
    assert worker._processes is None  # nothing of it runs in a child
    with running(worker):
        enqueue(committed, "coroutine")
        enqueue(committed, "in_transaction")
        recorder.wait_for(2)
    assert seen == {"async": os.getpid(), "transaction": os.getpid()}
