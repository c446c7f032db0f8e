"""The Celery app that the real ``celery -A tests.integration.workerapp worker`` subprocesses
of ``test_celery_workers.py`` run, built like ``example_project/celery_app.py``.

Everything comes from environment variables the test sets (one broker queue, Redis key
prefix and MongoDB database per test), so the workers and the test process build the same
app from the same settings: the test process with ``build(env)``, a worker through the
module attribute ``app`` (built on first access from ``os.environ``).

Steps:

* ``it.add``    quick: ``a + b``.
* ``it.slow``   (bind) runs ``seconds`` in 50 ms ticks, stops early when told its lease was
  lost, and appends ``start``/``end`` entries (invocation id, attempt, pid, lease_lost) to
  the Redis list named by ``ledger``, so a test sees how often the body ran and what it
  was told.
* ``it.flaky``  (bind) fails its first ``fail`` attempts.
* ``it.parked`` quick, but routed to ``<queue>.parked``, a queue no worker consumes: its
  step stays pending, a target for forged messages.

Graphs: ``graph_features`` (per-item fan-out, parallel and sequential, a join, a loop
counted in the run state, an error route), ``graph_endless`` (a loop that only
``max_visits`` stops) and ``graph_slow`` (a node like ``it.slow``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery, signals

from pikku_celery import (
    MongoWorkflowStore,
    PikkuCelery,
    RedisLeaseService,
    StepContext,
    with_state,
)
from tests.support.counting import CountingRedis, MongoCommands

ENV_BROKER = "PIKKU_IT_BROKER_URL"
ENV_REDIS = "PIKKU_IT_REDIS_URL"
ENV_LEASES = "PIKKU_IT_LEASES_URL"  # leases elsewhere (a Redis Cluster); else ENV_REDIS
ENV_MONGO = "PIKKU_IT_MONGO_URL"
ENV_PREFIX = "PIKKU_IT_KEY_PREFIX"
ENV_QUEUE = "PIKKU_IT_QUEUE"
ENV_STEP_LEASE = "PIKKU_IT_STEP_LEASE"
ENV_REAPER = "PIKKU_IT_REAPER_INTERVAL"
ENV_UNDISPATCHED = "PIKKU_IT_UNDISPATCHED_AFTER"
ENV_STALLED = "PIKKU_IT_STALLED_AFTER"
ENV_RUN_LEASE = "PIKKU_IT_RUN_LEASE"
ENV_VISIBILITY = "PIKKU_IT_VISIBILITY_TIMEOUT"  # Redis broker: force redeliveries
# "0": every step is a task of its own, never run in place (a test of a step task's Celery
# conventions: its task id, its state, its log lines).
ENV_IN_PLACE = "PIKKU_IT_IN_PLACE_STEPS"
# A Redis hash the workers add what each task they ran cost to (MongoDB commands and
# documents of the store's client, Redis commands of the lease service's, the task's name),
# with no reaper running: the step budget measured on real worker processes.
ENV_TALLY = "PIKKU_IT_TALLY"
ENV_TIME_LIMIT = "PIKKU_IT_TASK_TIME_LIMIT"  # the app-wide task_time_limit, in seconds

ADD = "it.add"
SLOW = "it.slow"
SLOW_DEFAULT = "it.slow_default"
FLAKY = "it.flaky"
PARKED = "it.parked"
PLACE = "it.place"  # transactional: writes an order with ctx.session
TICK_S = 0.05


def parked_queue(queue: str) -> str:
    return f"{queue}.parked"


def build(env: Mapping[str, str]) -> Celery:
    """A fresh Celery app with a ``PikkuCelery`` bound as ``app.pikku``."""
    app = Celery(f"pikku_it_{env[ENV_QUEUE]}", broker=env[ENV_BROKER], set_as_current=False)
    app.conf.update(_celery_conf(env))
    mongo, leases = MongoCommands(), RedisLeaseService.from_url(
        env.get(ENV_LEASES) or env[ENV_REDIS], key_prefix=env[ENV_PREFIX])
    if env.get(ENV_TALLY):
        counting = CountingRedis.from_url(env[ENV_REDIS])
        leases = RedisLeaseService(counting, key_prefix=env[ENV_PREFIX])
        _tally_tasks(app, env[ENV_REDIS], env[ENV_TALLY], mongo, counting)
    pikku = PikkuCelery(
        app,
        store=MongoWorkflowStore.from_url(env[ENV_MONGO], serverSelectionTimeoutMS=5000,
                                          event_listeners=[mongo]),
        leases=leases,
        worker_reaper=not env.get(ENV_TALLY),
        step_lease=float(env.get(ENV_STEP_LEASE, "1.5")),
        # A worker killed mid-pass holds the run for this long: keep it short.
        run_lease=float(env.get(ENV_RUN_LEASE, "3")),
        reaper_interval=float(env.get(ENV_REAPER, "0.3")),
        undispatched_after=float(env.get(ENV_UNDISPATCHED, "2")),
        stalled_after=float(env.get(ENV_STALLED, "3")),
        # The app runs only workflows: pikku's queue is its queue, so the workers (-Q
        # <queue>) consume only pikku's queue and run with prefetch 1.
        queue=env[ENV_QUEUE],
        in_place_steps=int(env.get(ENV_IN_PLACE, "100")),
    )
    _workflows(pikku, _steps(pikku, env[ENV_REDIS]))
    _feature_graph(pikku)
    _loop_graphs(pikku, env[ENV_REDIS])
    return app


def _tally_tasks(app: Celery, redis_url: str, tally: str, mongo: MongoCommands,
                 counting: CountingRedis) -> None:
    """After each task of ``app``, add what it cost to the hash ``tally`` (on a client of
    its own, not counted), and start the next task's count from zero."""
    plain = redis.Redis.from_url(redis_url)

    def started(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            mongo.clear()
            counting.commands.clear()

    def finished(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        pipe = plain.pipeline()
        pipe.hincrby(tally, "mongo", sum(mongo.commands.values()))
        pipe.hincrby(tally, "documents", sum(mongo.documents.values()))
        pipe.hincrby(tally, "redis", sum(counting.commands.values()))
        pipe.hincrby(tally, f"task:{sender.name}", 1)
        for name, n in mongo.commands.items():
            pipe.hincrby(tally, f"mongo:{name}", n)
        pipe.execute()

    signals.task_prerun.connect(started, weak=False)
    signals.task_postrun.connect(finished, weak=False)


def _celery_conf(env: Mapping[str, str]) -> dict[str, Any]:
    queue = env[ENV_QUEUE]
    conf: dict[str, Any] = {
        "task_default_queue": queue,
        "task_serializer": "json",
        "accept_content": ["json"],
        "broker_connection_retry_on_startup": True,
        "worker_enable_remote_control": False,  # no pidbox queues left behind
        "worker_send_task_events": False,
        "task_routes": {PARKED: {"queue": parked_queue(queue)}},
    }
    if env.get(ENV_TIME_LIMIT):
        conf["task_time_limit"] = float(env[ENV_TIME_LIMIT])
    if env[ENV_BROKER].startswith("amqp"):
        conf["broker_heartbeat"] = 0
    else:
        # Every broker key under the test's prefix (the key_prefix fixture deletes them),
        # including kombu's otherwise shared "unacked" bookkeeping.
        options: dict[str, Any] = {"global_keyprefix": f"{env[ENV_PREFIX]}:kombu:",
                                   "visibility_timeout": 3600}
        if env.get(ENV_VISIBILITY):
            # An unacked message older than this is put back on the queue by the next
            # restore sweep, which then runs every second (test-infrastructure.md).
            options.update(visibility_timeout=float(env[ENV_VISIBILITY]),
                           unacked_restore_interval=1, unacked_restore_throttle=1)
        conf["broker_transport_options"] = options
    return conf


class _Ledger:
    """Appends what a step body did to the Redis list its data names."""

    def __init__(self, redis_url: str) -> None:
        self._url = redis_url
        self._client: redis.Redis | None = None  # made lazily: after a prefork fork

    def add(self, data: dict[str, Any], ctx: StepContext, event: str) -> None:
        if self._client is None:
            self._client = redis.Redis.from_url(self._url)
        self._client.rpush(data["ledger"], json.dumps({
            "invocation_id": ctx.invocation_id, "attempt": ctx.attempt, "pid": os.getpid(),
            "event": event, "lease_lost": ctx.lease_lost, "t": time.time()}))


def _steps(pikku: PikkuCelery, redis_url: str) -> dict[str, Any]:
    ledger = _Ledger(redis_url)

    @pikku.step(ADD, retries=0)
    def add(data: dict[str, Any]) -> int:
        return int(data["a"]) + int(data["b"])

    def slow_body(ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
        ledger.add(data, ctx, "start")
        for _ in range(round(float(data["seconds"]) / TICK_S)):
            if ctx.wait_lost(TICK_S):
                break  # our outcome will be refused anyway: stop early
        ledger.add(data, ctx, "end")
        return {"attempt": ctx.attempt, "pid": os.getpid()}

    slow = pikku.step(SLOW, bind=True, retries=3, retry_delay="100ms")(slow_body)
    # Says nothing of retries: its body tries once, a lost worker's attempt runs again.
    pikku.step(SLOW_DEFAULT, bind=True)(slow_body)

    @pikku.step(FLAKY, bind=True, retries=3, retry_delay="100ms")
    def flaky(ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
        if ctx.attempt <= int(data["fail"]):
            raise RuntimeError(f"flaky failure on attempt {ctx.attempt}")
        return {"ok_on_attempt": ctx.attempt}

    @pikku.step(PLACE, bind=True, transactional=True, retries=3, retry_delay="100ms",
                lease="3s")
    def place(ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
        orders = ctx.session.client.get_default_database()["orders"]
        orders.insert_one({"order": data["order"], "attempt": ctx.attempt,
                           "pid": os.getpid()}, session=ctx.session)
        ledger.add(data, ctx, "start")
        time.sleep(float(data["seconds"]))  # inside the transaction, the order written
        ledger.add(data, ctx, "end")
        return {"attempt": ctx.attempt, "pid": os.getpid()}

    @pikku.step(PARKED, retries=0)  # routed to <queue>.parked: never consumed
    def parked(data: dict[str, Any]) -> str:
        return "parked ran"

    return {"add": add, "slow": slow, "flaky": flaky, "parked": parked, "place": place}


def _workflows(pikku: PikkuCelery, steps: dict[str, Any]) -> None:
    add, slow, flaky, parked = steps["add"], steps["slow"], steps["flaky"], steps["parked"]

    @pikku.workflow("pipeline")
    def pipeline(wf: Any, data: dict[str, Any]) -> dict[str, Any]:
        total = wf.do("sum", add, {"a": data["a"], "b": data["b"]})
        left, right = wf.gather(wf.call("left", add, {"a": total, "b": 1}),
                                wf.call("right", add, {"a": total, "b": 2}))
        wf.sleep("nap", "200ms")
        flaked = wf.do("flaky", flaky, {"fail": data["fail"]})
        return {"total": total, "left": left, "right": right, "flaky": flaked}

    @pikku.workflow("one_slow")
    def one_slow(wf: Any, data: dict[str, Any]) -> dict[str, Any]:
        step = SLOW_DEFAULT if data.get("default_retries") else slow
        slow_out = wf.do("slow", step, {"seconds": data["seconds"], "ledger": data["ledger"]},
                         retries=data.get("retries"))
        after = wf.do("after", add, {"a": slow_out["attempt"], "b": 100})
        return {"slow": slow_out, "after": after}

    @pikku.workflow("chain")
    def chain(wf: Any, data: dict[str, Any]) -> int:
        total = 0
        for i in range(int(data["n"])):
            total = wf.do(f"s{i}", add, {"a": total, "b": 1})
        return int(total)

    @pikku.workflow("forge_target")
    def forge_target(wf: Any, data: dict[str, Any]) -> dict[str, Any]:
        first = wf.do("first", add, {"a": 1, "b": 1})
        waiting = wf.do("parked", parked, {"first": first})
        return {"first": first, "parked": waiting}


    @pikku.workflow("wide")
    def wide(wf: Any, data: dict[str, Any]) -> list[int]:
        return wf.gather(*(wf.call(f"part{i}", add, {"a": data["base"], "b": i})
                           for i in range(data["width"])))

    @pikku.workflow("approved_sum")
    def approved_sum(wf: Any, data: dict[str, Any]) -> dict[str, Any]:
        decision = wf.approval("manager", approvers=["ann"], expiry=data.get("expiry"),
                               schema={"type": "object", "required": ["approved"]})
        if decision.get("expired"):
            return {"expired": True}
        return {"decision": decision, "sum": wf.do("sum", add, {"a": 1, "b": 2})}

    @pikku.workflow("txn_order")
    def txn_order(wf: Any, data: dict[str, Any]) -> dict[str, Any]:
        return {"placed": wf.do("place", steps["place"], data)}

    @pikku.workflow("limited", concurrency=1, concurrency_key=lambda d: d["customer"])
    def limited(wf: Any, data: dict[str, Any]) -> dict[str, Any]:
        return {"order": data["order"],
                "slow": wf.do("slow", slow, {"seconds": data["seconds"],
                                             "ledger": data["ledger"]})}

    @pikku.workflow("evented")
    def evented(wf: Any, data: dict[str, Any]) -> dict[str, Any]:
        wf.set_event("stage", "waiting")
        first = wf.wait_for_event("go")
        total = wf.do("sum", add, {"a": first["a"], "b": 1})
        wf.set_event("stage", "summed")
        second = wf.wait_for_event("go", timeout=data.get("timeout"), default={"a": -1})
        return {"first": first, "total": total, "second": second}


def _feature_graph(pikku: PikkuCelery) -> None:
    """One graph with every graph feature of issue 12: per-item fan-out (parallel and
    sequential), a join, a loop counted in the run state (``max_visits`` 5), an error
    route."""

    @pikku.step("it.g.items")
    def items(data: dict[str, Any]) -> Any:
        return with_state(data["input"]["items"], {"visits": 0})

    @pikku.step("it.g.square")
    def square(data: dict[str, Any]) -> int:
        return int(data["item"]) ** 2

    @pikku.step("it.g.running")
    def running(data: dict[str, Any]) -> Any:
        total = data["state"].get("total", 0) + int(data["item"])
        return with_state(total, {"total": total})

    @pikku.step("it.g.join")
    def join(data: dict[str, Any]) -> dict[str, Any]:
        return {"squares": data["from"]["square"], "totals": data["from"]["running"]}

    @pikku.step("it.g.tick")
    def tick(data: dict[str, Any]) -> Any:
        visits = data["state"]["visits"] + 1
        return with_state(visits, {"visits": visits})

    @pikku.step("it.g.charge", retries=1, retry_delay="50ms")
    def charge(data: dict[str, Any]) -> str:
        if data["input"].get("fail"):
            raise RuntimeError("card declined")
        return "charged"

    @pikku.step("it.g.refund")
    def refund(data: dict[str, Any]) -> dict[str, Any]:
        return {"refunded": data["error"]["message"], "visits": data["state"]["visits"]}

    pikku.graph(
        "graph_features",
        nodes={"items": items, "square": square, "running": running, "join": join,
               "tick": tick, "charge": charge, "refund": refund},
        edges=[("items", "square"), ("items", "running"), ("square", "join"),
               ("running", "join"), ("join", "tick"), ("tick", "tick"), ("tick", "charge")],
        for_each={"square": "items", "running": {"over": "items", "sequential": True}},
        branch={"tick": lambda visits: ["charge"] if visits >= 3 else ["tick"]},
        on_error={"charge": "refund"},
        max_visits={"tick": 5})



def _loop_graphs(pikku: PikkuCelery, redis_url: str) -> None:
    """A loop only ``max_visits`` stops, and a graph with a slow node (upstream scenario 52:
    a node whose worker dies is claimed again)."""
    ledger = _Ledger(redis_url)

    @pikku.step("it.g.spin")
    def spin(data: dict[str, Any]) -> int:
        return int(data["from"].get("spin", 0)) + 1

    @pikku.step("it.g.never")
    def never(data: dict[str, Any]) -> str:
        return "left the loop"

    pikku.graph("graph_endless", nodes={"spin": spin, "never": never},
                edges=[("spin", "spin"), ("spin", "never")],
                branch={"spin": lambda n: ["never"] if n > 1_000 else ["spin"]},
                max_visits={"spin": 4})

    @pikku.step("it.g.slow", bind=True, retries=2)
    def slow_node(ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
        ledger.add(data["input"], ctx, "start")
        for _ in range(round(float(data["input"]["seconds"]) / TICK_S)):
            if ctx.wait_lost(TICK_S):
                break
        ledger.add(data["input"], ctx, "end")
        return {"attempt": ctx.attempt, "after": data["from"]["spin"]}

    pikku.graph("graph_slow", nodes={"spin": spin, "slow": slow_node},
                edges=[("spin", "slow")])


_built: dict[str, Celery] = {}


def __getattr__(name: str) -> Any:
    # ``celery -A tests.integration.workerapp`` reads ``app``: built on first access, so a
    # plain import (by the test process) connects nothing and needs no environment.
    if name in ("app", "celery"):
        if "app" not in _built:
            _built["app"] = build(os.environ)
        return _built["app"]
    raise AttributeError(name)
