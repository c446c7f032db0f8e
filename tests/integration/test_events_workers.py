"""Events on real ``celery -A`` workers and the real MongoDB replica set (issue 26, item 1):
events sent before the run waits are kept and taken in the order sent; an event sent
after the run suspended at its wait, from another process, wakes it; a wait's timeout
gives its default; ``wf.set_event`` values are read while the run waits."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from tests.integration.test_celery_workers import ROOT, Cluster, make_cluster

__all__ = ["make_cluster"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _until(what: str, check: Callable[[], bool], c: Cluster, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{c.diagnostics()}")
        time.sleep(0.05)


def _send_from_another_process(c: Cluster, run_id: str, payload: str) -> None:
    code = ("import os, json, sys\n"
            "from tests.integration import workerapp as wa\n"
            "event = wa.build(os.environ).pikku.send_event(sys.argv[1], 'go',"
            " json.loads(sys.argv[2]))\n"
            "print(event.seq)\n")
    done = subprocess.run([sys.executable, "-c", code, run_id, payload], cwd=ROOT, env=c.env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_events_sent_before_the_waits_are_taken_in_order(
        make_cluster: Callable[..., Cluster], broker: str) -> None:
    c = make_cluster(broker)
    c.wait_ready(c.start("events"))
    run_id = c.pikku.start("evented", {})
    first = c.pikku.send_event(run_id, "go", {"a": 1})
    second = c.pikku.send_event(run_id, "go", {"a": 5}, key="second")
    assert c.pikku.send_event(run_id, "go", {"a": 9}, key="second") == second  # once
    run = c.wait(run_id, 30)
    assert run.status == "completed", (run, c.diagnostics())
    assert run.output == {"first": {"a": 1}, "total": 2, "second": {"a": 5}}
    assert [e.seq for e in c.pikku.list_events(run_id)] == [first.seq, second.seq]
    assert c.pikku.get_event(run_id, "stage") == "summed"


def test_an_event_sent_from_another_process_wakes_the_suspended_run(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis")
    c.wait_ready(c.start("events"))
    run_id = c.pikku.start("evented", {})
    _until("the run to wait for its first event", lambda: (
        c.pikku.get_run(run_id).status == "suspended"
        and c.pikku.get_event(run_id, "stage") == "waiting"), c)
    time.sleep(0.5)  # it stays suspended: nothing polls it awake
    assert c.pikku.get_run(run_id).status == "suspended"
    _send_from_another_process(c, run_id, '{"a": 2}')
    _until("the run to wait for its second event", lambda: (
        c.pikku.get_event(run_id, "stage") == "summed"
        and c.pikku.get_run(run_id).status == "suspended"), c)
    _send_from_another_process(c, run_id, '{"a": 7}')
    run = c.wait(run_id, 30)
    assert run.status == "completed", (run, c.diagnostics())
    assert run.output == {"first": {"a": 2}, "total": 3, "second": {"a": 7}}


def test_a_wait_that_times_out_gives_its_default(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis")
    c.wait_ready(c.start("events"))
    run_id = c.pikku.start("evented", {"timeout": "1s"})
    c.pikku.send_event(run_id, "go", {"a": 4})
    run = c.wait(run_id, 30)
    assert run.status == "completed", (run, c.diagnostics())
    assert run.output == {"first": {"a": 4}, "total": 5, "second": {"a": -1}}
    gate = c.step(run_id, "__event:go#2")
    assert gate.result == {"event": "go", "timed_out": True}
