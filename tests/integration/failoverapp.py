"""The Celery app the real ``celery -A tests.integration.failoverapp worker`` subprocesses of
``test_failover.py`` run: a MongoDB replica set as the store, Redis for leases and broker.

Everything comes from environment variables the test sets (one queue, key prefix and
database per test), so the workers and the test process build the same app: the test
process with ``build(env)``, a worker through the module attribute ``app``.

One workflow, ``chain``: ``first`` -> (``left`` || ``right``) -> ``last``, each step a
``fo.work`` body that sleeps ``seconds`` (in 50 ms ticks, stopping early when told its lease
was lost) and returns a value computed from its inputs, so the run's output says whether
each step's recorded result is the right one. Every body appends ``start``/``end`` entries
to a Redis list (the ledger), every pass ``pass`` as it replays the workflow (which then
sleeps ``replay_seconds``, so passes last long enough for a fault to find some in flight),
and every attempt the store acknowledged as settled appends ``settled`` (from pikku's
``step_attempt_finished`` signal, sent after the write was acknowledged): the test times
the fault against those.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery

from pikku_celery import MongoWorkflowStore, PikkuCelery, RedisLeaseService, StepContext
from pikku_celery import signals as pikku_signals

ENV_BROKER = "PIKKU_FO_BROKER_URL"
ENV_REDIS = "PIKKU_FO_REDIS_URL"
ENV_MONGO = "PIKKU_FO_MONGO_URL"
ENV_PREFIX = "PIKKU_FO_KEY_PREFIX"
ENV_QUEUE = "PIKKU_FO_QUEUE"
ENV_LEDGER = "PIKKU_FO_LEDGER"
ENV_STEP_LEASE = "PIKKU_FO_STEP_LEASE"
ENV_RUN_LEASE = "PIKKU_FO_RUN_LEASE"
ENV_REAPER = "PIKKU_FO_REAPER_INTERVAL"
ENV_UNDISPATCHED = "PIKKU_FO_UNDISPATCHED_AFTER"
ENV_STALLED = "PIKKU_FO_STALLED_AFTER"

WORK = "fo.work"
TICK_S = 0.05


def expected_output(x: int) -> dict[str, int]:
    """What a ``chain`` run of input ``x`` must return when every step's result is its own."""
    first = 2 * x
    left, right = first + 1, first + 2
    return {"first": first, "left": left, "right": right, "last": left + right}


def build(env: Mapping[str, str]) -> Celery:
    app = Celery(f"pikku_fo_{env[ENV_QUEUE]}", broker=env[ENV_BROKER], set_as_current=False)
    app.conf.update(
        task_default_queue=env[ENV_QUEUE],
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        broker_transport_options={"global_keyprefix": f"{env[ENV_PREFIX]}:kombu:",
                                  "visibility_timeout": 3600},
    )
    pikku = PikkuCelery(
        app,
        store=MongoWorkflowStore.from_url(env[ENV_MONGO]),
        leases=RedisLeaseService.from_url(env[ENV_REDIS], key_prefix=env[ENV_PREFIX]),
        step_lease=float(env[ENV_STEP_LEASE]),
        run_lease=float(env[ENV_RUN_LEASE]),
        reaper_interval=float(env[ENV_REAPER]),
        undispatched_after=float(env[ENV_UNDISPATCHED]),
        stalled_after=float(env[ENV_STALLED]),
        queue=env[ENV_QUEUE],
    )
    ledger = _Ledger(env[ENV_REDIS], env[ENV_LEDGER])

    @pikku.step(WORK, bind=True, retries=4, retry_delay="100ms")
    def work(ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
        ledger.add("start", ctx.run_id, ctx.step_name, ctx.attempt, ctx.invocation_id)
        for _ in range(round(float(data["seconds"]) / TICK_S)):
            if ctx.wait_lost(TICK_S):
                break  # our outcome will be refused anyway: stop early
        ledger.add("end", ctx.run_id, ctx.step_name, ctx.attempt, ctx.invocation_id,
                   lease_lost=ctx.lease_lost)
        return {"value": int(data["value"]), "attempt": ctx.attempt, "pid": os.getpid(),
                "invocation": ctx.invocation_id}

    @pikku.workflow("chain")
    def chain(wf: Any, data: dict[str, Any]) -> dict[str, int]:
        # Each pass replays this function: a pause here makes every pass last
        # ``replay_seconds``, so a fault finds passes in flight as well as bodies.
        ledger.add("pass", wf.run_id, "", 0, None)
        time.sleep(float(data.get("replay_seconds", 0)))
        s = data["seconds"]
        first = wf.do("first", work, {"value": 2 * data["x"], "seconds": s})["value"]
        left, right = wf.gather(wf.call("left", work, {"value": first + 1, "seconds": s}),
                                wf.call("right", work, {"value": first + 2, "seconds": s}))
        last = wf.do("last", work, {"value": left["value"] + right["value"], "seconds": s})
        return {"first": first, "left": left["value"], "right": right["value"],
                "last": last["value"]}

    def settled(sender: Any = None, **fields: Any) -> None:
        if fields.get("pikku") is pikku:
            ledger.add("settled", fields["run_id"], fields["step_name"], fields["attempt"],
                       None, status=fields["status"])

    pikku_signals.step_attempt_finished.connect(settled, weak=False)
    return app


class _Ledger:
    """Appends to the test's Redis list; the client is made lazily (after a prefork fork)."""

    def __init__(self, redis_url: str, key: str) -> None:
        self._url = redis_url
        self._key = key
        self._client: redis.Redis | None = None

    def add(self, event: str, run_id: str, step_name: str, attempt: int,
            invocation: str | None, **extra: Any) -> None:
        if self._client is None:
            self._client = redis.Redis.from_url(self._url)
        self._client.rpush(self._key, json.dumps({
            "event": event, "run": run_id, "step": step_name, "attempt": attempt,
            "invocation": invocation, "pid": os.getpid(), "t": time.time(), **extra}))


_built: dict[str, Celery] = {}


def __getattr__(name: str) -> Any:
    # ``celery -A tests.integration.failoverapp`` reads ``app``: built on first access.
    if name in ("app", "celery"):
        if "app" not in _built:
            _built["app"] = build(os.environ)
        return _built["app"]
    raise AttributeError(name)
