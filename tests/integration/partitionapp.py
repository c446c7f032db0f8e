"""The Celery app of ``test_partitions.py``'s ``celery -A tests.integration.partitionapp``
workers, each in a network namespace of the partition rig (``tests/support/netrig.py``).

As ``failoverapp.py`` (the same ``chain`` workflow: ``first`` -> (``left`` || ``right``) ->
``last``, outputs computed from inputs), with two differences a partition calls for:

* the ledger is a file per process (JSON lines in ``PN_LEDGER_DIR``), not a Redis list: a
  worker cut off from Redis must still say what it did; entries carry ``time.monotonic()``
  (``m``: system-wide, and left alone by libfaketime with
  ``FAKETIME_DONT_FAKE_MONOTONIC=1``, so skewed workers' entries compare) and the worker's
  name;
* a body can be *stubborn* (``data["stubborn"]``): it runs its whole length even after its
  lease is lost (recording a ``lost`` entry the first time it sees the loss), then returns,
  so its settle is tried after the heal and must be refused. A polite body stops at the
  loss, as a body should.

The ``settled`` entry is written from ``step_attempt_finished`` (sent after the store
acknowledged the settle), ``superseded`` from ``step_attempt_superseded`` (a refused
settle).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celery import Celery

from pikku_celery import MongoWorkflowStore, PikkuCelery, RedisLeaseService, StepContext
from pikku_celery import signals as pikku_signals

ENV_BROKER = "PN_BROKER_URL"
ENV_REDIS = "PN_REDIS_URL"
ENV_MONGO = "PN_MONGO_URL"
ENV_PREFIX = "PN_KEY_PREFIX"
ENV_QUEUE = "PN_QUEUE"
ENV_LEDGER = "PN_LEDGER_DIR"
ENV_WORKER = "PN_WORKER"
ENV_STEP_LEASE = "PN_STEP_LEASE"
ENV_RUN_LEASE = "PN_RUN_LEASE"
ENV_REAPER = "PN_REAPER_INTERVAL"
ENV_UNDISPATCHED = "PN_UNDISPATCHED_AFTER"
ENV_STALLED = "PN_STALLED_AFTER"

WORK = "pn.work"
TICK_S = 0.05


def expected_output(x: int) -> dict[str, int]:
    first = 2 * x
    left, right = first + 1, first + 2
    return {"first": first, "left": left, "right": right, "last": left + right}


class Ledger:
    """Appends JSON lines to ``<dir>/<worker>-<pid>.jsonl`` (one ``write`` per entry, in
    append mode: whole lines)."""

    def __init__(self, directory: str, worker: str) -> None:
        self._dir = Path(directory)
        self._worker = worker
        self._lock = threading.Lock()

    def add(self, event: str, run_id: str, step_name: str, attempt: int,
            invocation: str | None, **extra: Any) -> None:
        line = json.dumps({"event": event, "run": run_id, "step": step_name,
                           "attempt": attempt, "invocation": invocation,
                           "w": self._worker, "pid": os.getpid(), "m": time.monotonic(),
                           "t": time.time(), **extra}) + "\n"
        path = self._dir / f"{self._worker}-{os.getpid()}.jsonl"
        with self._lock, open(path, "a") as f:
            f.write(line)


def read_ledger(directory: Path) -> list[dict[str, Any]]:
    entries = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except ValueError:  # a line being written
                    continue
    entries.sort(key=lambda e: e["m"])
    return entries


def build(env: Mapping[str, str]) -> Celery:
    app = Celery(f"pikku_pn_{env[ENV_QUEUE]}", broker=env[ENV_BROKER], set_as_current=False)
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
    ledger = Ledger(env[ENV_LEDGER], env.get(ENV_WORKER, "client"))

    @pikku.step(WORK, bind=True, retries=6, retry_delay="100ms")
    def work(ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
        ledger.add("start", ctx.run_id, ctx.step_name, ctx.attempt, ctx.invocation_id)
        told = False
        for _ in range(round(float(data["seconds"]) / TICK_S)):
            if ctx.wait_lost(TICK_S):
                if not told:
                    told = True
                    ledger.add("lost", ctx.run_id, ctx.step_name, ctx.attempt,
                               ctx.invocation_id)
                if not data.get("stubborn"):
                    break  # our outcome will be refused anyway: stop early
                time.sleep(TICK_S)
        ledger.add("end", ctx.run_id, ctx.step_name, ctx.attempt, ctx.invocation_id,
                   lease_lost=ctx.lease_lost)
        return {"value": int(data["value"]), "attempt": ctx.attempt, "pid": os.getpid(),
                "invocation": ctx.invocation_id}

    @pikku.workflow("chain")
    def chain(wf: Any, data: dict[str, Any]) -> dict[str, int]:
        ledger.add("pass", wf.run_id, "", 0, None)
        s = data["seconds"]
        st = bool(data.get("stubborn"))
        # ``first_seconds``: a first step longer than the step lease, for a fault that
        # must find a body running past its lease.
        first = wf.do("first", work, {"value": 2 * data["x"],
                                      "seconds": data.get("first_seconds", s),
                                      "stubborn": st})["value"]
        left, right = wf.gather(
            wf.call("left", work, {"value": first + 1, "seconds": s, "stubborn": st}),
            wf.call("right", work, {"value": first + 2, "seconds": s, "stubborn": st}))
        last = wf.do("last", work, {"value": left["value"] + right["value"], "seconds": s,
                                    "stubborn": st})
        return {"first": first, "left": left["value"], "right": right["value"],
                "last": last["value"]}

    def settled(sender: Any = None, **fields: Any) -> None:
        if fields.get("pikku") is pikku:
            ledger.add("settled", fields["run_id"], fields["step_name"], fields["attempt"],
                       None, status=fields["status"])

    def superseded(sender: Any = None, **fields: Any) -> None:
        if fields.get("pikku") is pikku:
            ledger.add("superseded", fields["run_id"], fields["step_name"],
                       fields["attempt"], None, current=fields.get("current_attempt"))

    pikku_signals.step_attempt_finished.connect(settled, weak=False)
    pikku_signals.step_attempt_superseded.connect(superseded, weak=False)
    return app


_built: dict[str, Celery] = {}


def __getattr__(name: str) -> Any:
    if name in ("app", "celery"):
        if "app" not in _built:
            _built["app"] = build(os.environ)
        return _built["app"]
    raise AttributeError(name)
