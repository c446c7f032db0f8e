"""``celery -A <app> pikku ...`` as real subprocesses: Celery's own CLI finds the command
group through the ``celery.commands`` entry point, loads the app, and the commands read the
runs the test process wrote (the real MongoDB of the session, real Redis). Also the
standalone dashboard, ``pikku dashboard``, served by a real process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pymongo
import pytest

from tests.conftest import REDIS_URL
from tests.support.mongod import MongoTarget, free_port

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.integration.cliapp"


@pytest.fixture
def env(mongo_server: MongoTarget, key_prefix: str) -> Iterator[dict[str, str]]:
    database = f"cli_{key_prefix[-12:]}"
    yield {**os.environ, "PIKKU_CLI_MONGO_URL": mongo_server.url_for(database),
           "PIKKU_CLI_REDIS_URL": REDIS_URL, "PIKKU_CLI_KEY_PREFIX": key_prefix,
           "PYTHONPATH": str(ROOT)}
    with pymongo.MongoClient(mongo_server.url, serverSelectionTimeoutMS=5000) as client:
        client.drop_database(database)


def celery(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "celery", "-A", APP, "pikku", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def completed_run(env: dict[str, str]) -> str:
    """A run started and finished inline by this process, on the subprocess's stores."""
    code = ("from tests.integration.cliapp import pikku; "
            "print(pikku.start('sum', {'a': 2, 'b': 40}, inline=True))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_every_celery_command_loads_the_entry_point_without_importing_pikku() -> None:
    """Celery loads every ``celery.commands`` entry point at the start of any ``celery``
    command, other apps' workers included: pikku's must cost them neither pikku nor
    pymongo, and still list its commands when asked."""
    code = ("import sys; from celery.bin.celery import celery; "
            "assert 'pikku' in celery.commands; "
            "print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('pikku_celery', 'pymongo', 'rich')))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"
    listed = subprocess.run([sys.executable, "-m", "celery", "pikku", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert {"runs", "show", "watch", "cancel", "approve"} <= {
        line.split()[0] for line in listed.stdout.split("Commands:")[1].splitlines()
        if line.strip()}


@pytest.mark.slow
def test_celery_a_app_pikku_show_and_its_errors(env: dict[str, str]) -> None:
    run_id = completed_run(env)
    shown = celery(env, "show", run_id)
    assert shown.returncode == 0, shown.stderr
    assert run_id in shown.stdout and "completed" in shown.stdout
    assert [line.split()[:3] for line in shown.stdout.splitlines()
            if line.startswith("add ")] == [["add", "1/4", "succeeded"]]
    as_json = json.loads(celery(env, "show", run_id, "--json").stdout)
    assert as_json["run"]["output"] == 42

    missing = celery(env, "show", "ghost")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.strip().splitlines() == [
        "Error: WorkflowRunNotFoundError: no workflow run with id 'ghost'"]

    checked = celery(env, "check")
    assert "MongoDB at mongodb://127.0.0.1:" in checked.stdout
    assert "ok       Redis at redis://127.0.0.1:6379/0 answered" in checked.stdout
    assert "workflows (1): sum" in checked.stdout and "steps (1): cli.add" in checked.stdout
    # The store created its indexes when the test wrote its runs: every one is found.
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr


def test_celery_a_app_pikku_schedules_pause_resume_and_trigger(env: dict[str, str]) -> None:
    fresh = celery(env, "schedules")
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout.splitlines() == [
        "no schedules", "declared here but not in the store yet (a worker saves them when "
                        "it starts): yearly"]
    paused = celery(env, "schedule", "pause", "yearly")  # saves it first
    assert (paused.returncode, paused.stdout) == (0, "paused schedule yearly\n")
    listed = celery(env, "schedules")
    [row] = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert row[:11] == ["yearly", "sum", "cron", "0", "0", "1", "1", "*", "UTC", "latest",
                        "paused"]
    triggered = celery(env, "schedule", "trigger", "yearly")
    assert triggered.returncode == 0, triggered.stderr
    run_id = triggered.stdout.strip()
    shown = json.loads(celery(env, "show", run_id, "--json").stdout)["run"]
    assert (shown["schedule"], shown["input"]) == ("yearly", {"a": 20, "b": 22})
    assert shown["scheduled_for"] is not None
    assert celery(env, "schedule", "resume", "yearly").stdout.startswith(
        "resumed schedule yearly; next tick ")
    data = json.loads(celery(env, "schedules", "--json").stdout)["schedules"]
    assert [(s["name"], s["paused"], s["timing"]) for s in data] == [
        ("yearly", False, "cron 0 0 1 1 *")]
    missing = celery(env, "schedule", "trigger", "nope")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.strip().splitlines() == [
        "Error: no schedule named 'nope'; declared here: yearly"]


@pytest.mark.slow
def test_celery_a_app_pikku_with_mongodb_down_is_one_line(env: dict[str, str]) -> None:
    env = {**env, "PIKKU_CLI_MONGO_URL":
           f"mongodb://127.0.0.1:{free_port()}/x?serverSelectionTimeoutMS=300"}
    listed = celery(env, "runs")
    assert listed.returncode == 1
    lines = listed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: MongoUnreachableError: MongoDB at")


@pytest.mark.slow
def test_pikku_dashboard_serves_the_runs_page_from_its_own_process(
        env: dict[str, str]) -> None:
    run_id = completed_run(env)
    port = free_port()
    server = subprocess.Popen(  # no PIKKU_DASHBOARD_TOKEN: it draws one, served by waitress
        [sys.executable, "-m", "celery", "-A", APP, "pikku", "dashboard", "--port", str(port)],
        cwd=ROOT, env={k: v for k, v in env.items() if k != "PIKKU_DASHBOARD_TOKEN"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        first = server.stdout.readline()  # printed once the server is bound
        printed = re.fullmatch(rf"pikku dashboard on http://127\.0\.0\.1:{port}/\?token=(\S+) "
                               r"\(open it once; Ctrl-C to stop\)", first.strip())
        assert printed is not None, first
        token = printed.group(1)
        assert len(token) >= 32
        base = f"http://127.0.0.1:{port}"
        refused = _get(f"{base}/", None)
        assert refused[0] == 401
        status, page = _get(f"{base}/", token)
        assert status == 200 and run_id in page and "completed" in page
        status, api = _get(f"{base}/api/runs/{run_id}", token)
        assert status == 200 and json.loads(api)["output"] == 42
    finally:
        server.terminate()
        server.wait(timeout=30)


def _get(url: str, token: str | None) -> tuple[int, str]:
    """GET with a bearer token, retrying until the server accepts connections."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                        timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except (ConnectionRefusedError, urllib.error.URLError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
