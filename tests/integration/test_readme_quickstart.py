"""The README's Quickstart, as written, on a real ``celery -A proj worker``: the app module
is the README's ``proj.py`` with only its service URLs pointed at this test's MongoDB (a
database on the session's mongod) and Redis, and this test's own queue and key prefixes added
at the end of the module, after ``PikkuCelery(app)`` (pikku reads its settings at first use,
so they apply)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest

from tests.conftest import REDIS_URL
from tests.support.mongod import MongoTarget
from tests.support.readme import readme_example

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


@pytest.fixture
def quickstart(tmp_path: Path, mongo_server: MongoTarget, key_prefix: str) -> Iterator[Path]:
    database = f"pikku_quickstart_{uuid.uuid4().hex[:10]}"
    code = readme_example("proj.py")
    assert "mongodb://127.0.0.1:27017/proj" in code and "redis://127.0.0.1:6379/0" in code
    code = code.replace("mongodb://127.0.0.1:27017/proj", mongo_server.url_for(database))
    code = code.replace("redis://127.0.0.1:6379/0", REDIS_URL)
    code += (f"\n# test isolation, set after PikkuCelery(app): read at first use\n"
             f"app.conf.task_default_queue = {key_prefix + '-q'!r}\n"
             f"app.conf.broker_transport_options = "
             f"{{'global_keyprefix': {key_prefix + ':kombu:'!r}}}\n"
             f"app.conf.pikku_key_prefix = {key_prefix!r}\n")
    (tmp_path / "proj.py").write_text(code)
    yield tmp_path
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(mongo_server.url)
    client.drop_database(database)
    client.close()


def test_the_quickstart_runs_on_a_celery_worker(quickstart: Path) -> None:
    log_path = quickstart / "worker.log"
    env = {**os.environ, "PYTHONPATH": str(quickstart), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "proj", "worker", "--loglevel", "INFO",
             "-c", "2", "-n", f"quickstart-{uuid.uuid4().hex[:6]}@%h"],
            cwd=quickstart, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while "ready." not in log_path.read_text(errors="replace"):
            assert worker.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.1)

        spec = importlib.util.spec_from_file_location("quickstart_proj",
                                                      quickstart / "proj.py")
        assert spec is not None and spec.loader is not None
        proj = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(proj)
        pikku = proj.pikku

        run_id = pikku.start("checkout", {"id": "o-1", "amount": 42})
        assert pikku.wait(run_id, timeout=30).output == {"reservation": "r-o-1",
                                                         "charged": 42}
        assert [(a.step_name, a.attempt, a.status) for a in pikku.get_history(run_id)] == [
            ("reserve", 1, "succeeded"), ("charge", 1, "succeeded")]
        proj.app.close()
        pikku.engine.store.db.client.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(5)
