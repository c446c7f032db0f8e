"""Transactional steps on a MongoDB of their own (issue 26, item 4): a standalone server is
refused by name, and the docs example runs as written on the replica set and Redis. The
inline engine's cases on the session's replica set (the body's writes commit with the
settle; a failed body, a superseded or cancelled attempt, a failed or unknown commit leave
no write) are in the fast tier, tests/unit/test_transactional_fast.py; the SIGSTOP case on
real workers is in test_transactional_workers.py."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    MongoWorkflowStore,
    PikkuCelery,
)
from pikku_celery.worker.inline import run_inline
from tests.conftest import REDIS_URL
from tests.support.mongod import MongoTarget, free_port, mongod_binary
from tests.support.readme import readme_example

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
def database(mongo_server: MongoTarget) -> Iterator[tuple[str, str]]:
    name = f"pikku_txn_{uuid.uuid4().hex[:10]}"
    yield mongo_server.url_for(name), name
    with pymongo.MongoClient(mongo_server.url) as client:
        client.drop_database(name)


class Shop:
    """A PikkuCelery on the real replica set, with one transactional step whose body the
    test steers through ``self.during`` (called inside the transaction, after the write)."""

    def __init__(self, url: str, name: str) -> None:
        self.store = MongoWorkflowStore.from_url(url)
        self.orders = self.store.db.client[name]["orders"]
        self.pikku = PikkuCelery(Celery(f"txn-{uuid.uuid4().hex[:8]}", broker="memory://"),
                                 store=self.store, leases=InMemoryLeaseService(),
                                 worker_reaper=False)
        self.during: Any = None
        shop = self

        @self.pikku.step(name="txn.place", bind=True, transactional=True, retries=2,
                         retry_delay="10ms")
        def place(ctx: Any, data: Any) -> dict[str, Any]:
            orders = ctx.session.client[name]["orders"]
            orders.insert_one({"order": data["order"], "attempt": ctx.attempt},
                              session=ctx.session)
            if shop.during is not None:
                shop.during(ctx)
            return {"placed": data["order"], "attempt": ctx.attempt}

        @self.pikku.workflow("txn_order")
        def order(wf: Any, data: Any) -> Any:
            return wf.do("place", place, data)

    def written(self) -> list[tuple[str, int]]:
        return sorted((d["order"], d["attempt"]) for d in self.orders.find({}))

    def start(self, order: str) -> str:
        return self.pikku.start("txn_order", {"order": order})

    def close(self) -> None:
        self.store.db.client.close()


def test_a_standalone_server_is_refused_by_name(tmp_path: Path) -> None:
    binary = mongod_binary()
    if binary is None and os.environ.get("PIKKU_TEST_MONGO_URL") and not os.environ.get("CI"):
        pytest.skip("no mongod binary here: the suite uses PIKKU_TEST_MONGO_URL's server")
    assert binary is not None, "no mongod binary to start a standalone server (CI needs one)"
    port = free_port()
    (tmp_path / "db").mkdir()
    proc = subprocess.Popen([binary, "--dbpath", str(tmp_path / "db"), "--port", str(port),
                             "--bind_ip", "127.0.0.1", "--logpath", str(tmp_path / "log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        url = f"mongodb://127.0.0.1:{port}/shop"
        deadline = time.monotonic() + 30
        while True:
            try:
                with pymongo.MongoClient(url, serverSelectionTimeoutMS=500) as client:
                    client.admin.command("ping")
                break
            except Exception:
                assert time.monotonic() < deadline, (tmp_path / "log").read_text()[-2000:]
                time.sleep(0.2)
        shop = Shop(url + "?w=1", "shop")
        try:
            run = run_inline(shop.pikku.engine, shop.start("o-6"))
            assert run.status == "failed"
            assert run.error is not None
            assert ("PikkuConfigurationError: step 'place' is transactional, and MongoDB at "
                    in run.error["message"])
            assert "has no transactions (a standalone server)" in run.error["message"]
            assert shop.written() == []
            history = [(a.attempt, a.status) for a in shop.pikku.get_history(run.run_id)]
            assert history == [(1, "failed")]  # refused at once: no attempt spent retrying
        finally:
            shop.close()
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_docs_example_runs_as_written(database: tuple[str, str], key_prefix: str) -> None:
    """docs/guide/transactional-steps.md's placing.py, its URLs pointed at this test's
    replica set and Redis (settings are read at first use)."""
    code = readme_example("placing.py")
    namespace: dict[str, Any] = {"__name__": "placing"}
    exec(compile(code, "docs/guide/transactional-steps.md:placing.py", "exec"), namespace)
    url, name = database
    app = namespace["app"]
    app.conf.pikku_mongo_url = url
    app.conf.pikku_redis_url = REDIS_URL
    app.conf.pikku_key_prefix = key_prefix
    pikku = namespace["pikku"]
    try:
        run_id = pikku.start("order", {"order_id": "o-7", "total": 12, "sku": "tea"},
                             inline=True)
        assert pikku.get_run(run_id).output == {"placed": "o-7"}
        shop = pikku.engine.store.db.client[name]
        assert shop["orders"].find_one({"_id": "o-7"}) == {"_id": "o-7", "total": 12}
        assert shop["stock"].find_one({"_id": "tea"}) == {"_id": "tea", "left": -1}
    finally:
        pikku.engine.store.db.client.close()
