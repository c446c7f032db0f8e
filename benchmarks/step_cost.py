"""Round trips per step, whole system: MongoDB commands (pymongo command monitoring), the
documents and bytes their replies return, Redis commands (a counting client) and broker
messages, for the workers' side (claim, body, settle, and with ``continue_in_place`` the
pass that follows) and the orchestrator's side (``<namespace>.orchestrate`` passes).

Counts, not seconds: they are the same on any machine. One process plays every part: a
queue stands in for the broker and delivers each message the engine publishes, in order,
to the engine call its Celery task would make (a step message to ``execute_step``, an
orchestrator message to ``advance`` with the step it names). Starting the run is not
counted. The store is the one users get (``MongoWorkflowStore.from_url``: majority writes
with a 10 s ``wtimeout``, majority reads). Runs against the MongoDB in ``PIKKU_MONGO_URL``,
else a real ``mongod`` started as a single-node replica set, and Redis from
``PIKKU_REDIS_URL`` or 127.0.0.1:6379 (``example_project/stack.py``); the first line printed
names the MongoDB measured (``benchmarks.target``). Not nx-27017: it refuses the store's
sweep indexes (they end in ``_id``), and its counts were never a server's.

    python -m benchmarks.step_cost [--steps 20] [--fanout 100]
"""

from __future__ import annotations

import argparse
import contextlib
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from celery import Celery

from benchmarks.target import counting_store, describe
from example_project.stack import Stack
from pikku_celery import PikkuCelery, RedisLeaseService
from pikku_celery.model.errors import LeaseTakenError
from tests.support.counting import CountingRedis, MongoCommands

SIDES = ("worker", "orchestrator")


class Broker:
    """Stands in for the broker: queues the messages the engine publishes, counts them."""

    carries_claims = True  # as ``CeleryDispatcher``: a step's message carries its hint

    def __init__(self) -> None:
        self.queue: deque[tuple[str, str, str | None, object]] = deque()
        self.messages: Counter[str] = Counter()
        self.delivering = False  # a message is being handled: a worker's task runs

    def runs_here(self, function: str, run_id: str, step_name: str) -> bool:
        """One queue, one task class, no time limits: a delivered message's pass may run
        the next step in place, as ``CeleryDispatcher.runs_here`` allows in a worker."""
        return self.delivering

    def dispatch_step(self, function: str, run_id: str, step_name: str, *,
                      expected: object = None) -> None:
        self.messages["step"] += 1
        self.queue.append(("step", run_id, step_name, expected))

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        self.messages["orchestrate"] += 1
        self.queue.append(("run", run_id, step_name, None))

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        self.messages["timer"] += 1


@dataclass
class Side:
    mongo: Counter[str] = field(default_factory=Counter)
    documents: int = 0
    reply_bytes: int = 0
    redis: Counter[str] = field(default_factory=Counter)


@dataclass
class Result:
    shape: str
    steps: int
    in_place: bool
    sides: dict[str, Side]
    messages: Counter[str]
    in_place_steps: int = 0

    def per_step(self, side: str | None, what: str) -> float:
        chosen = [self.sides[side]] if side else list(self.sides.values())
        total = 0
        for s in chosen:
            value = getattr(s, what)
            total += sum(value.values()) if isinstance(value, Counter) else value
        return total / self.steps


def measure(shape: str, steps: int, redis_url: str, mongo_url: str, *,
            in_place: bool, in_place_steps: int = 100) -> Result:
    """One run of ``steps`` no-op steps, ``sequential`` (one after another) or ``fanout``
    (all gathered at once), every message delivered and counted. ``in_place``: steps
    continue in place (``continue_in_place``), running up to ``in_place_steps`` steps in a
    row in place (0: each step is sent)."""
    mongo = MongoCommands()
    store = counting_store(mongo_url, f"pikku_bench_{uuid.uuid4().hex[:8]}", [mongo])
    client = store.db.client
    redis_client = CountingRedis.from_url(redis_url)
    prefix = f"pikku-bench-{uuid.uuid4().hex[:8]}"
    pikku = PikkuCelery(Celery("bench", broker="memory://"), store=store,
                        leases=RedisLeaseService(redis_client, key_prefix=prefix),
                        continue_in_place=in_place, in_place_steps=in_place_steps,
                        worker_reaper=False)
    broker = Broker()
    pikku.engine.dispatcher = broker

    @pikku.step(name="bench.noop")
    def noop(data: Any) -> Any:
        return data

    @pikku.workflow("bench.sequential")
    def sequential(wf: Any, n: int) -> int:
        for i in range(n):
            wf.do(f"s{i}", noop, i)
        return n

    @pikku.workflow("bench.fanout")
    def fanout(wf: Any, n: int) -> int:
        return len(wf.gather(*(wf.call(f"s{i}", noop, i) for i in range(n))))

    try:
        run_id = pikku.start(f"bench.{shape}", steps)
        broker.messages.clear()
        definition = pikku.registry.steps["bench.noop"]
        sides = {name: Side() for name in SIDES}
        while broker.queue:
            kind, target, step_name, expected = broker.queue.popleft()
            broker.delivering = True
            if kind == "step":
                assert step_name is not None
                _count(mongo, redis_client, sides["worker"], partial(
                    pikku.engine.execute_step, expected=expected), definition, target,
                    step_name)
            else:
                _count(mongo, redis_client, sides["orchestrator"], _advance, pikku, target,
                       step_name)
            broker.delivering = False
        assert pikku.get_run(run_id).status == "completed", pikku.get_run(run_id)
        return Result(shape, steps, in_place, sides, Counter(broker.messages),
                      in_place_steps if in_place else 0)
    finally:
        doomed = list(redis_client.scan_iter(match=f"{prefix}:*"))
        if doomed:
            redis_client.delete(*doomed)
        client.drop_database(store.db.name)
        client.close()


def _advance(pikku: PikkuCelery, run_id: str, step_name: str | None) -> None:
    # What the orchestrate task does: a run held elsewhere keeps the mark this call left.
    with contextlib.suppress(LeaseTakenError):
        pikku.engine.advance(run_id, step_name=step_name)


def _count(mongo: MongoCommands, redis_client: CountingRedis, into: Side, fn: Any,
           *args: Any) -> None:
    mongo.clear()
    redis_client.commands.clear()
    fn(*args)
    into.mongo.update(mongo.commands)
    into.documents += sum(mongo.documents.values())
    into.reply_bytes += sum(mongo.reply_bytes.values())
    into.redis.update(redis_client.commands)


def report(result: Result) -> str:
    n = result.steps
    if not result.in_place:
        mode = "continue_in_place=False: a message per settle"
    elif result.in_place_steps:
        mode = f"running in place (in_place_steps={result.in_place_steps})"
    else:
        mode = "in_place_steps=0: the worker passes after its step, sends the next"
    lines = [f"step_cost: {result.shape}, {n} steps, {mode}; per step"]
    for side in SIDES:
        s = result.sides[side]
        detail = ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(s.mongo.items()))
        lines.append(
            f"  {side:<12} mongo {result.per_step(side, 'mongo'):5.2f} ({detail or '-'}); "
            f"documents {s.documents / n:5.2f}, {s.reply_bytes / n / 1024:6.2f} KB; "
            f"redis {result.per_step(side, 'redis'):5.2f}")
    messages = ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(result.messages.items()))
    lines.append(
        f"  {'whole system':<12} mongo {result.per_step(None, 'mongo'):5.2f}; documents "
        f"{result.per_step(None, 'documents'):5.2f}, "
        f"{result.per_step(None, 'reply_bytes') / 1024:6.2f} KB; "
        f"redis {result.per_step(None, 'redis'):5.2f}; broker messages "
        f"{sum(result.messages.values()) / n:.2f} ({messages})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="sequential steps per run")
    parser.add_argument("--fanout", type=int, default=100, help="calls in the gather")
    args = parser.parse_args(argv)
    with Stack() as stack:
        print(f"step_cost on {describe(stack.mongo_url)}\n")
        for shape, n in (("sequential", args.steps), ("fanout", args.fanout)):
            for in_place, in_place_steps in ((True, 100), (True, 0), (False, 0)):
                print(report(measure(shape, n, stack.redis_url, stack.mongo_url,
                                     in_place=in_place, in_place_steps=in_place_steps)))
                print()


if __name__ == "__main__":
    main()
