"""The Celery app the chaos harness runs on real ``celery -A tests.chaos.chaosapp`` workers.

Configured from ``CHAOS_*`` environment variables. Every step body appends to an external
ledger (one JSON line per event in a file per worker process, so it survives Redis and
MongoDB restarts) with its invocation id, attempt and pid; every result carries the attempt
and pid that produced it, so the checker can tell which attempt's write was recorded.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery
from pymongo.errors import AutoReconnect

from pikku_celery import (
    MongoWorkflowStore,
    PikkuCelery,
    RedisLeaseService,
    StepContext,
    WorkflowContext,
    signals,
)
from pikku_celery.store.base import NewRun

ENV = os.environ
TICK_SCHEDULE = "chaos-tick"  # the schedule whose ticks start ``chaos.ticked`` runs
LIMITED_CONCURRENCY = 1  # ``chaos.limited`` runs of one key at once
BOOKINGS = "chaos_bookings"  # the app collection ``chaos.book`` writes in its transaction
if ENV.get("CHAOS_SKEW_S"):  # a worker whose wall clock is off by minutes
    import time_machine

    time_machine.travel(time.time() + float(ENV["CHAOS_SKEW_S"]), tick=True).start()

LEDGER_DIR = ENV.get("CHAOS_LEDGER", "/tmp/pikku-chaos-ledger")

app = Celery("chaos", broker=ENV.get("CHAOS_BROKER", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_default_queue=ENV.get("CHAOS_QUEUE", "chaos"),
    broker_heartbeat=0,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    worker_hijack_root_logger=False,
    broker_transport_options={"visibility_timeout": float(ENV.get("CHAOS_VISIBILITY_S", "3600")),
                              "unacked_restore_interval": 1, "unacked_restore_throttle": 1},
)


class ChaosStore(MongoWorkflowStore):
    """The MongoDB store, with two injected faults on creating a child run whose input asks
    for them: the first try fails as a dropped connection does (issue 8, item 2: the
    parent's step is recorded, its child is not, and only the reaper can notice); or the
    first try pauses before it writes, with a ledger line, so the harness can cancel the
    parent while its pass sits between recording the child's step and creating the child
    (issue 21: the child must end cancelled and run no step)."""

    def create_run(self, run: NewRun, now_ms: int) -> Any:
        pause_s = isinstance(run.input, dict) and run.input.get("pause_create_s")
        if run.parent_run_id is not None and pause_s and _once(f"child-create-paused-"
                                                               f"{run.run_id}"):
            ledger("child_creating", None, run=run.parent_run_id, child=run.run_id,
                   seconds=pause_s)
            time.sleep(float(pause_s))
            ledger("child_create_resumed", None, run=run.parent_run_id, child=run.run_id)
        wants = isinstance(run.input, dict) and run.input.get("fail_create_once")
        if run.parent_run_id is not None and wants:
            marker = os.path.join(LEDGER_DIR, f"child-create-failed-{run.run_id}")
            try:  # once per child, across every process: O_EXCL decides
                os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                pass
            else:
                ledger("child_create_failed", None, run=run.parent_run_id, child=run.run_id)
                raise AutoReconnect("chaos: connection lost while creating a child run")
        return super().create_run(run, now_ms)


def _once(name: str) -> bool:
    """True the first time ``name`` is asked for, across every process (O_EXCL decides)."""
    try:
        os.close(os.open(os.path.join(LEDGER_DIR, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                         0o644))
    except FileExistsError:
        return False
    return True


STORE = ChaosStore.from_url(ENV.get("CHAOS_MONGO", "mongodb://127.0.0.1/chaos"),
                           serverSelectionTimeoutMS=3000)
pikku = PikkuCelery(
    app,
    store=STORE,
    leases=RedisLeaseService.from_url(ENV.get("CHAOS_REDIS", "redis://127.0.0.1:6379/0"),
                                      key_prefix=ENV.get("CHAOS_PREFIX", "chaos")),
    step_lease=float(ENV.get("CHAOS_LEASE_S", "2")),
    run_lease=float(ENV.get("CHAOS_RUN_LEASE_S", "3")),
    reaper_interval=float(ENV.get("CHAOS_REAPER_S", "0.5")),
    undispatched_after=float(ENV.get("CHAOS_UNDISPATCHED_S", "3")),
    stalled_after=float(ENV.get("CHAOS_STALLED_S", "3")),
    max_countdown=5,
    # The app runs only workflows: its queue is pikku's, so its workers get prefetch 1.
    queue=ENV.get("CHAOS_QUEUE", "chaos"),
)


def ledger(event: str, ctx: StepContext | None, **fields: Any) -> None:
    entry = {"event": event, "t": time.monotonic(), "wall": time.time(), "pid": os.getpid(),
             **fields}
    if ctx is not None:
        entry.update(run=ctx.run_id, step=ctx.step_name, attempt=ctx.attempt,
                     invocation=ctx.invocation_id, lost=ctx.lease_lost)
    line = (json.dumps(entry) + "\n").encode()
    fd = os.open(os.path.join(LEDGER_DIR, f"{os.getpid()}.jsonl"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)  # one small O_APPEND write: whole lines even across threads
    finally:
        os.close(fd)


def _settled(sender: Any, run_id: str, step_name: str, attempt: int, status: str,
             **kwargs: Any) -> None:
    """Sent after the store recorded the attempt's outcome: when steps settle again after a
    MongoDB fault (no ``invocation``: the checker's body bookkeeping skips it)."""
    ledger("settled", None, run=run_id, step=step_name, attempt=attempt, status=status)


signals.step_attempt_finished.connect(_settled)


class Fatal(Exception):
    pass


@pikku.step(name="chaos.work", retries=3, retry_delay="100ms", bind=True)
def work(ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
    kind = data.get("kind", "ok")
    # A slow body says how long it sleeps: the stale-write fault picks one with time left.
    ledger("start", ctx, **({"seconds": data.get("seconds", 1.0)} if kind == "slow" else {}))
    if kind == "slow":
        time.sleep(data.get("seconds", 1.0))  # never stops early: a late write is the point
    if kind == "flaky" and ctx.attempt < data.get("fail_until", 2):
        ledger("raise", ctx)
        raise ConnectionError(f"flaky attempt {ctx.attempt}")
    if kind == "fatal":
        ledger("raise", ctx)
        raise Fatal(f"fatal step of order {data.get('order')}")
    ledger("end", ctx)
    return {"attempt": ctx.attempt, "pid": os.getpid(), "invocation": ctx.invocation_id}


@pikku.step(name="chaos.compensate", retries=3, retry_delay="100ms", bind=True)
def compensate(ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
    ledger("start", ctx)
    ledger("compensate", ctx, because=data["error"].get("message"))
    ledger("end", ctx)
    return {"attempt": ctx.attempt, "pid": os.getpid(), "invocation": ctx.invocation_id}


@pikku.workflow("chaos.order")
def order(wf: WorkflowContext, spec: dict[str, Any]) -> dict[str, Any]:
    """Seven steps: ok, flaky, slow, a fan-out of two, a sleep, and a last step that is
    fatal for some orders (compensated once, then the run fails)."""
    ledger("pass", None, run=wf.run_id)
    time.sleep(0.25)  # a pass takes a moment, so kills can land in the middle of one
    try:
        return _order_steps(wf, spec)
    finally:  # runs on a pause too (a BaseException): the ledger sees every pass end
        ledger("pass_end", None, run=wf.run_id)


def _order_steps(wf: WorkflowContext, spec: dict[str, Any]) -> dict[str, Any]:
    n = spec["order"]
    first = wf.do("reserve", work, {"kind": "ok", "order": n})
    wf.do("charge", work, {"kind": "flaky", "fail_until": spec.get("fail_until", 2),
                           "order": n})
    wf.do("courier", work, {"kind": "slow", "seconds": spec.get("slow_s", 0.3), "order": n})
    left, right = wf.gather(wf.call("email", work, {"kind": "ok", "order": n}),
                            wf.call("sms", work, {"kind": "ok", "order": n}))
    wf.sleep("pickup", "50ms")
    last = wf.do("ship", work, {"kind": "fatal" if spec.get("fatal") else "ok", "order": n},
                 on_error=compensate)
    return {"first": first["attempt"], "last": last["attempt"],
            "notified": [left["attempt"], right["attempt"]]}


# --- inputs that probe issue 8's fixes (started by tests/chaos/faults.py) -------------------


@pikku.step(name="chaos.big", retries=3, retry_delay="100ms", bind=True)
def big(ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
    """Returns a result as large as its data: each passes the per-value limit, together
    they pass MongoDB's 16 MiB document. The attempt must fail at once, not retry."""
    ledger("start", ctx)
    ledger("end", ctx)
    return {"blob": "y" * len(data["blob"]), "attempt": ctx.attempt}


@pikku.workflow("chaos.oversized")
def oversized(wf: WorkflowContext, spec: dict[str, Any]) -> Any:
    return wf.do("big", big, {"blob": "x" * (spec["mb"] * 1024 * 1024)})


@pikku.workflow("chaos.invoice")
def invoice(wf: WorkflowContext, spec: dict[str, Any]) -> Any:
    return wf.do("bill", work, {"kind": "ok", "order": spec.get("order", -1)})


@pikku.workflow("chaos.parent")
def parent(wf: WorkflowContext, spec: dict[str, Any]) -> Any:
    """A child run as one step; ``fail_child_create`` makes its first creation fail,
    ``pause_child_create_s`` pauses it (the pass holds the run meanwhile)."""
    child_input: dict[str, Any] = {"order": spec.get("order", -1)}
    if spec.get("fail_child_create"):
        child_input["fail_create_once"] = True
    if spec.get("pause_child_create_s"):
        child_input["pause_create_s"] = spec["pause_child_create_s"]
    return {"invoice": wf.child("invoice", "chaos.invoice", child_input)}


@pikku.workflow("chaos.squat")
def squat(wf: WorkflowContext, spec: dict[str, Any]) -> Any:
    """Started under a run id ``<victim>:ship``: its step ``on_error`` would share an id with
    the victim's ``ship:on_error`` step if ids were joined with ':' alone."""
    return wf.do("on_error", work, {"kind": "ok", "order": -1})


# --- issue 26's primitives: events, a schedule, a concurrency limit, a transactional step ---


@pikku.workflow("chaos.awaiter")
def awaiter(wf: WorkflowContext, spec: dict[str, Any]) -> dict[str, Any]:
    """Waits for the events ``spec["waits"]`` names, in turn (``[name, timeout_s or None]``):
    the driver sends them during the faults, some before the run reaches its wait, some
    after, some twice with one key; a wait with a timeout is never sent to, and takes its
    default. Publishes how many waits it passed; returns every payload it took."""
    ledger("pass", None, run=wf.run_id)
    try:
        wf.do("before", work, {"kind": "ok", "order": spec.get("order", -1)})
        taken = []
        for name, timeout in spec["waits"]:
            if timeout is None:
                taken.append(wf.wait_for_event(name))
            else:
                taken.append(wf.wait_for_event(name, timeout=timeout,
                                               default={"timed_out": name}))
            wf.set_event("progress", len(taken))
        wf.do("after", work, {"kind": "ok", "order": spec.get("order", -1)})
        return {"taken": taken}
    finally:
        ledger("pass_end", None, run=wf.run_id)


@pikku.workflow("chaos.ticked")
def ticked(wf: WorkflowContext, spec: Any) -> dict[str, Any]:
    """Started by the schedule's ticks: one step that names its tick."""
    tick = wf.scheduled_for
    wf.do("tick", work, {"kind": "ok", "order": -2,
                         "tick": tick.isoformat() if tick else None})
    return {"tick": tick.isoformat() if tick else None}


@pikku.step(name="chaos.book", retries=3, retry_delay="100ms", transactional=True, bind=True)
def book(ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
    """Writes one booking per attempt (per try of it: a transient error runs the body again
    in a new transaction) in an app collection, in the step's transaction: only the
    attempt whose outcome is recorded may leave its booking."""
    ledger("txn_start", ctx)
    session = ctx.session
    assert session is not None  # a transactional step on MongoDB always has one
    session.client[STORE.db.name][BOOKINGS].insert_one(
        {"_id": f"{ctx.invocation_id}:{ctx.attempt}", "run": ctx.run_id, "step": ctx.step_name,
         "attempt": ctx.attempt, "pid": os.getpid(), "key": data.get("key")},
        session=session)
    ledger("txn_end", ctx)
    return {"attempt": ctx.attempt, "pid": os.getpid(), "invocation": ctx.invocation_id}


@pikku.workflow("chaos.limited", concurrency=LIMITED_CONCURRENCY,
                concurrency_key=lambda spec: spec["key"])
def limited(wf: WorkflowContext, spec: dict[str, Any]) -> dict[str, Any]:
    """At most ``LIMITED_CONCURRENCY`` runs per key at once: a slow step, then a booking
    written in a transactional step."""
    ledger("pass", None, run=wf.run_id)
    try:
        held = wf.do("hold", work, {"kind": "slow", "seconds": spec.get("slow_s", 0.5),
                                    "order": spec.get("order", -1)})
        booked = wf.do("book", book, {"key": spec["key"]})
        return {"held": held["attempt"], "booked": booked["attempt"]}
    finally:
        ledger("pass_end", None, run=wf.run_id)


pikku.schedule(TICK_SCHEDULE, "chaos.ticked", every=ENV.get("CHAOS_TICK_EVERY", "2s"),
               catch_up="latest")


# --- issue 31: retry and fork in the mix ------------------------------------------------------


@pikku.workflow("chaos.approver")
def approver(wf: WorkflowContext, spec: dict[str, Any]) -> dict[str, Any]:
    """Waits for an approval the driver gives during the faults (some runs are cancelled
    while they wait, then retried: the reopened gate must wait for the driver's decision
    again); returns the decision."""
    ledger("pass", None, run=wf.run_id)
    try:
        wf.do("before", work, {"kind": "ok", "order": spec.get("order", -1)})
        decision = wf.approval("go")
        wf.do("after", work, {"kind": "ok", "order": spec.get("order", -1)})
        return {"decision": decision}
    finally:
        ledger("pass_end", None, run=wf.run_id)
