"""Issue 33, parts 3-5, on a real ``celery -A ... worker -E`` (prefork) beside a real Flower:

* Flower's HTTP API lists every attempt of a run, each under the task id its history entry
  records, with its state: the steps run in place (pikku sends their task events) as well
  as the ones sent as tasks (Celery sends theirs), retries as RETRY, a failure as FAILURE;
* the worker's log has Celery's ``Task <name>[<id>] succeeded in ...s: <result>`` line for
  each step run in place, and the ``pikku_celery`` records carry the run, workflow, step and
  attempt as record attributes (a log file formatted with them);
* sentry-sdk (Celery integration, a transport writing events to a file): a step failing
  for good in place is one event, the step's (its task name and task id, tagged with its
  run, step and attempt), and nothing is reported for ``orchestrate`` nor for the attempts
  that were retried.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration import obsapp
from tests.integration.test_celery_workers import ROOT, Cluster, Worker, make_cluster, wait_for

__all__ = ["make_cluster"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

FLOWER_STATES = {"succeeded": "SUCCESS", "failed": "FAILURE"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def flower(tmp_path: Path) -> Iterator[Callable[[Cluster], str]]:
    """A real Flower on the cluster's broker: its base URL once its API answers."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(cluster: Cluster) -> str:
        port = _free_port()
        log = open(tmp_path / "flower.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.integration.workerapp", "flower",
             f"--port={port}", "--address=127.0.0.1"],
            cwd=ROOT, env={**cluster.env, "FLOWER_UNAUTHENTICATED_API": "true"},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/api/tasks", timeout=2) as response:
                    return int(response.status) == 200
            except (OSError, urllib.error.URLError):
                return False

        wait_for(up, 30, "Flower's API", lambda: (tmp_path / "flower.log").read_text())
        return url

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _start_worker(c: Cluster, tmp_path: Path) -> Worker:
    """``Cluster.start``'s worker, with task events on (``-E``) and ``obsapp``'s app."""
    name = f"obs-{uuid.uuid4().hex[:6]}"
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.integration.obsapp", "worker", "-E",
             "-P", "prefork", "-c", "2", "-Q", c.queue, "-n", f"{name}@%h",
             "--without-gossip", "--without-mingle", "--loglevel", "INFO"],
            cwd=ROOT, env=c.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    worker = Worker(name, "prefork", proc, log_path)
    c.workers.append(worker)
    return worker


def _flower_tasks(url: str) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/tasks", timeout=5) as response:
        tasks: dict[str, dict[str, Any]] = json.loads(response.read())
    return tasks


def test_flower_logs_and_sentry_see_every_step_run_in_place(
        make_cluster: Callable[..., Cluster], flower: Callable[[Cluster], str],
        tmp_path: Path) -> None:
    sentry_file, fields_log = tmp_path / "sentry.jsonl", tmp_path / "fields.log"
    c = make_cluster("redis", **{obsapp.ENV_SENTRY_FILE: str(sentry_file),
                                 obsapp.ENV_FIELDS_LOG: str(fields_log)})
    obsapp.add_workflows(c.pikku)
    url = flower(c)
    worker = _start_worker(c, tmp_path)
    c.wait_ready(worker)

    chain = c.pikku.start("chain", {"n": 4})  # every step in place
    flaky = c.pikku.start("pipeline", {"a": 1, "b": 2, "fail": 1})  # sent, retried, in place
    broken = c.pikku.start("obs_fail", {})  # its second step fails for good, in place
    assert c.wait(chain, 30).output == 4
    assert c.wait(flaky, 30).status == "completed"
    assert c.wait(broken, 30).status == "failed"

    history = {run: c.pikku.get_history(run) for run in (chain, flaky, broken)}
    expected: dict[str, tuple[str, str]] = {}
    for entries in history.values():
        for h in entries:
            if h.step_name == "nap":
                continue  # a sleep: no task runs
            # ``flaky`` fails once with attempts left: a retry, as Celery's RETRY.
            state = "RETRY" if h.step_name == "flaky" and h.status == "failed" else (
                FLOWER_STATES[h.status])
            assert h.task_id, h
            expected[h.task_id] = (h.step_name, state)
    naps = sum(h.step_name == "nap" for e in history.values() for h in e)
    assert len(expected) == sum(len(e) for e in history.values()) - naps  # one id an attempt

    def listed() -> bool:
        tasks = _flower_tasks(url)
        return all(tasks.get(i, {}).get("state") == s for i, (_, s) in expected.items())

    wait_for(listed, 15, "Flower to list every attempt", lambda: json.dumps(
        {i: (expected[i], _flower_tasks(url).get(i, {}).get("state")) for i in expected}))
    tasks = _flower_tasks(url)
    for task_id, (_step, state) in expected.items():
        task = tasks[task_id]
        assert task["name"].startswith("it.") and task["worker"].startswith("obs-"), task
        if state == "SUCCESS":
            assert task["runtime"] is not None and task["runtime"] >= 0, task
    s0 = tasks[next(h.task_id for h in history[chain] if h.step_name == "s0")]
    assert s0["args"] == repr((chain, "s0")) and s0["result"] == "1", s0

    # The worker log: Celery's line for each step run in place, under its task id.
    log = worker.log()
    for h in history[chain]:
        assert f"Task it.add[{h.task_id}] succeeded in " in log, log
    (boom,) = [h for h in history[broken] if h.step_name == "boom"]
    assert f"Task {obsapp.BOOM}[{boom.task_id}] received" not in log  # ran in place
    assert (f"Task {obsapp.BOOM}[{boom.task_id}] raised unexpected: "
            "LookupError('no such thing: 2')") in log

    # Structured fields: each pikku record carries the attempt it is about.
    lines = fields_log.read_text().splitlines()
    s1 = next(h for h in history[chain] if h.step_name == "s1")
    assert f"{chain}|chain|s1|1|INFO|Task it.add[{s1.task_id}] succeeded in " in "\n".join(
        lines), lines

    # Sentry: the step that failed for good in place is one event, the step's.
    events = [json.loads(line) for line in sentry_file.read_text().splitlines()]
    (event,) = events
    assert event["tags"]["pikku.run_id"] == broken and event["tags"]["pikku.step"] == "boom"
    assert event["tags"]["pikku.attempt"] == "1"
    assert event["tags"]["celery_task_id"] == boom.task_id
    assert event["transaction"] == obsapp.BOOM
    assert event["exception"]["values"][-1]["type"] == "LookupError"
