"""``engine.busy_runs``: the guess that a run is held elsewhere lasts a moment, ends when the
run is found free, and remembers a bounded number of runs (the oldest forgotten first)."""

from __future__ import annotations

from pikku_celery.engine.busy_runs import BusyRuns


def test_a_run_found_held_is_likely_held_for_a_moment_only() -> None:
    now = [100.0]
    busy = BusyRuns(busy_for_s=1.0, clock=lambda: now[0])
    assert not busy.likely_held("r1")
    busy.found_held("r1")
    now[0] += 0.999
    assert busy.likely_held("r1")
    assert not busy.likely_held("r2")
    now[0] += 0.001
    assert not busy.likely_held("r1")


def test_a_run_found_free_is_no_longer_likely_held() -> None:
    busy = BusyRuns()
    busy.found_held("r1")
    busy.found_free("r1")
    assert not busy.likely_held("r1")
    busy.found_free("never-seen")  # nothing to forget: no error


def test_it_remembers_at_most_max_runs_the_oldest_forgotten_first() -> None:
    busy = BusyRuns(max_runs=3)
    for run_id in ("r1", "r2", "r3"):
        busy.found_held(run_id)
    busy.found_held("r1")  # seen again: now the newest
    busy.found_held("r4")
    assert [busy.likely_held(r) for r in ("r1", "r2", "r3", "r4")] == [True, False, True, True]
