"""The Celery app the throughput and fan-out benchmarks run on real workers (configured by
environment: broker, result backend, queue, MongoDB, Redis key prefix, in place or not)."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import before_task_publish, task_prerun

app = Celery("benchapp", broker=os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/0"),
             backend=os.environ.get("BENCH_BACKEND") or None)
app.conf.update(task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
                broker_heartbeat=0, worker_hijack_root_logger=False,
                broker_connection_retry_on_startup=True,
                # No pidbox queues: a measurement leaves nothing in the broker but its queue.
                worker_enable_remote_control=False)
if os.environ.get("BENCH_TIME_LIMIT"):  # benchmarks.throughput --time-limit
    app.conf.task_time_limit = float(os.environ["BENCH_TIME_LIMIT"])


@app.task(name="bench.plain_noop")
def plain_noop(x: Any) -> Any:
    return x


@app.task(name="bench.claimed_noop", bind=True)
def claimed_noop(self: Any, x: Any) -> Any:
    """A no-op task that first makes the one write any durably claimed step must make before
    its body: a guarded majority update of its own document (the attempt advanced), as a
    claim is. With Celery's MongoDB result backend recording its result after it, a chain of
    these is the floor of sequential steps that are claimed and recorded durably, two
    majority writes per step, with none of pikku's leases, replay or fencing."""
    _claims().update_one({"_id": self.request.id}, {"$inc": {"attempt": 1}}, upsert=True)
    return x


@app.task(name="bench.leased_noop", bind=True)
def leased_noop(self: Any, x: Any) -> Any:
    """``claimed_noop`` with the Redis round trips the contract adds to a claimed step: its
    step lease taken before the claim, and the run lease taken and given back by the one
    orchestrator that advances the run after the body (``SET NX PX``, ``SET NX PX``,
    ``DEL``). With the result write, the floor of a sent step under pikku's contract."""
    leases = _counter()
    key = f"{os.environ.get('BENCH_PREFIX', 'bench')}:floor:{self.request.id}"
    leases.set(f"{key}:step", "holder", nx=True, px=30_000)
    _claims().update_one({"_id": self.request.id}, {"$inc": {"attempt": 1}}, upsert=True)
    leases.set(f"{key}:run", "holder", nx=True, px=30_000)
    leases.delete(f"{key}:run")
    return x


def _claims() -> Any:
    global _CLAIMS
    if _CLAIMS is None:
        import pymongo

        client: Any = pymongo.MongoClient(os.environ.get("BENCH_MONGO",
                                                         "mongodb://127.0.0.1/b"),
                                          w="majority")
        _CLAIMS = client.get_default_database()["bench_claims"]
    return _CLAIMS


_CLAIMS: Any = None


@app.task(name="bench.join")
def join(results: list[Any]) -> int:
    return len(results)


COUNTS = os.environ.get("BENCH_COUNTS")  # a Redis hash: executions and sends by task name


@task_prerun.connect
def _count_execution(sender: Any = None, **kwargs: Any) -> None:
    if COUNTS and sender is not None:
        _counter().hincrby(COUNTS, sender.name, 1)


@before_task_publish.connect
def _count_sent(sender: Any = None, **kwargs: Any) -> None:
    if COUNTS and sender:  # ``sender`` is the task name here; a delayed one counts too
        _counter().hincrby(COUNTS, f"sent:{sender}", 1)


def _counter() -> Any:
    import redis

    global _REDIS
    if _REDIS is None:
        _REDIS = redis.Redis.from_url(os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/0"))
    return _REDIS


_REDIS: Any = None


if os.environ.get("BENCH_BARE") != "1":  # the memory benchmark's bare worker: no pikku
    from pikku_celery import MongoWorkflowStore, PikkuCelery, RedisLeaseService

    pikku = PikkuCelery(
        app,
        store=MongoWorkflowStore.from_url(os.environ.get("BENCH_MONGO",
                                                         "mongodb://127.0.0.1/b")),
        leases=RedisLeaseService.from_url(
            os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/0"),
            key_prefix=os.environ.get("BENCH_PREFIX", "bench")),
        continue_in_place=os.environ.get("BENCH_IN_PLACE", "1") == "1",
        # "0": every step sent as a task of its own (before issue 24's running in place).
        in_place_steps=int(os.environ.get("BENCH_IN_PLACE_STEPS", "100")),
    )

    @pikku.step(name="bench.step_noop")
    def step_noop(x: Any) -> Any:
        return x

    @pikku.workflow("bench.sequence")
    def sequence(wf: Any, n: int) -> int:
        for i in range(n):
            wf.do(f"s{i}", step_noop, i)
        return n

    @pikku.workflow("bench.fanout")
    def fanout(wf: Any, n: int) -> int:
        return len(wf.gather(*(wf.call(f"s{i}", step_noop, i) for i in range(n))))
