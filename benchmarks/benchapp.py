"""The Celery app the throughput benchmark runs on real workers (configured by env)."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from pikku_celery import MongoWorkflowStore, PikkuCelery, RedisLeaseService

app = Celery("benchapp", broker=os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/0"),
             backend=os.environ.get("BENCH_BACKEND", "redis://127.0.0.1:6379/0"))
app.conf.update(task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
                broker_heartbeat=0, worker_hijack_root_logger=False,
                broker_connection_retry_on_startup=True)
pikku = PikkuCelery(
    app,
    store=MongoWorkflowStore.from_url(os.environ.get("BENCH_MONGO", "mongodb://127.0.0.1/b")),
    leases=RedisLeaseService.from_url(os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/0"),
                                      key_prefix=os.environ.get("BENCH_PREFIX", "bench")),
    continue_in_place=os.environ.get("BENCH_IN_PLACE") == "1",
)


@app.task(name="bench.plain_noop")
def plain_noop(x: Any) -> Any:
    return x


@pikku.step(name="bench.step_noop")
def step_noop(x: Any) -> Any:
    return x


@pikku.workflow("bench.sequence")
def sequence(wf: Any, n: int) -> int:
    for i in range(n):
        wf.do("s", step_noop, i)
    return n
