"""How many slot threads a kind's runs can use (sqlaq.worker.slots.Demand): one plus twice their
wait over their CPU time, the wait read off the quickest run of a window."""

from __future__ import annotations

from sqlaq.worker.slots import SAMPLE, WINDOW, Demand


def _window(demand: Demand, wall: float, cpu: float, runs: int = WINDOW) -> list[bool]:
    return [demand.add(wall, cpu if demand.reads() else None) for _ in range(runs)]


def test_the_first_runs_give_the_first_figure() -> None:
    demand = Demand()
    assert demand.want == 0
    assert demand.reads()
    # sleeps 10 ms, computes 50 us
    assert _window(demand, 0.010, 0.000_05, SAMPLE) == [False] * (SAMPLE - 1) + [True]
    assert demand.want == 399


def test_a_kind_that_only_computes_wants_one_thread() -> None:
    demand = Demand()
    _window(demand, 0.000_01, 0.000_01, SAMPLE)
    assert demand.want == 1
    # Waits for the GIL make most runs look ten times longer than they compute; the
    # quickest of the window did not wait.
    walls = [0.000_1] * (WINDOW - 1) + [0.000_012]
    for wall in walls:
        demand.add(wall, 0.000_01 if demand.reads() else None)
    assert demand.want == 1


def test_each_window_replaces_the_last_figure() -> None:
    demand = Demand()
    _window(demand, 0.000_01, 0.000_01, SAMPLE)
    closed = _window(demand, 0.001, 0.000_1)  # now waits 0.9 ms for each 0.1 computed
    assert closed == [False] * (WINDOW - 1) + [True]
    assert demand.want == 19
    _window(demand, 0.000_2, 0.000_1)  # and now 0.1
    assert demand.want == 3


def test_cpu_time_is_read_on_one_run_in_sample() -> None:
    demand = Demand()
    _window(demand, 0.001, 0.001, SAMPLE)
    reads = []
    for _ in range(WINDOW):
        reads.append(demand.reads())
        demand.add(0.001, 0.001 if reads[-1] else None)
    assert sum(reads) == WINDOW // SAMPLE
    assert reads[0]  # the first run of each window among them
