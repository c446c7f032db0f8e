"""``celery -A <app> pikku ...`` as real subprocesses whose stdout is a pipe (issue 25
item 6): ``runs`` prints whole values, not columns cut to a width; ``watch`` prints each
change of the run as it happens (the first line is read while the run still waits) and
ends with a newline; ``resume`` of a run waiting at an approval is one line and exit 1."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pymongo
import pytest

from tests.conftest import REDIS_URL
from tests.support.mongod import MongoTarget

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.integration.cliapp_gates"
LONG_ID = "order-" + "7" * 150  # wider than any terminal

pytestmark = pytest.mark.slow


@pytest.fixture
def env(mongo_server: MongoTarget, key_prefix: str) -> Iterator[dict[str, str]]:
    database = f"clipipe_{key_prefix[-12:]}"
    yield {**os.environ, "PIKKU_CLI_MONGO_URL": mongo_server.url_for(database),
           "PIKKU_CLI_REDIS_URL": REDIS_URL, "PIKKU_CLI_KEY_PREFIX": key_prefix,
           "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    with pymongo.MongoClient(mongo_server.url, serverSelectionTimeoutMS=5000) as client:
        client.drop_database(database)


def celery(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "celery", "-A", APP, "pikku", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_runs_watch_and_resume_in_a_pipe(env: dict[str, str]) -> None:
    code = (f"from {APP} import pikku; "
            f"print(pikku.start('gated', None, inline=True, run_id={LONG_ID!r}))")
    started = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr

    listed = celery(env, "runs")
    assert listed.returncode == 0, listed.stderr
    [row] = [line for line in listed.stdout.splitlines() if line.startswith("order-")]
    assert row.split()[:3] == [LONG_ID, "gated", "suspended"]
    assert "…" not in row and len(row.split()) == 7  # the two times whole, date and time

    refused = celery(env, "resume", LONG_ID)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        f"Error: run {LONG_ID} waits for approval 'manager', which resume does not open: "
        f"decide it with `pikku approve {LONG_ID} manager --decision JSON`"]

    watcher = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", APP, "pikku", "watch", LONG_ID,
         "--interval", "0.2"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert watcher.stdout is not None
    reader = threading.Thread(target=lambda: [lines.put(x) for x in watcher.stdout or ()],
                              daemon=True)
    reader.start()
    try:
        first = lines.get(timeout=60)  # printed while the run still waits
        assert first.startswith(f"run {LONG_ID} suspended: 0/1 steps settled"), first
        assert "waiting for approval 'manager'" in first
        cancelled = celery(env, "cancel", LONG_ID, "--reason", "test")
        assert cancelled.returncode == 0, cancelled.stderr
        assert watcher.wait(timeout=60) == 2, watcher.stderr.read() if watcher.stderr else ""
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait(timeout=30)
    reader.join(timeout=10)
    rest = "".join(lines.queue)
    assert f"run {LONG_ID} cancelled:" in rest
    assert rest.endswith("\n")
