"""Round trips per step execution: MongoDB commands (pymongo command monitoring) and Redis
commands (a counting client), on the worker side and on the orchestrator side.

Counts, not seconds: they are the same on any machine. Runs against the MongoDB in
``PIKKU_MONGO_URL`` or the nx-27017 stand-in, and Redis from ``PIKKU_REDIS_URL`` or
127.0.0.1:6379 (see example_project/stack.py).

    python -m benchmarks.step_cost [--steps 20]
"""

from __future__ import annotations

import argparse
import uuid
from collections import Counter
from typing import Any

from celery import Celery

from example_project.stack import Stack
from pikku_celery import MongoWorkflowStore, PikkuCelery, RedisLeaseService
from tests.support.counting import CountingRedis, counting_mongo


class Wakes:
    """Stands in for the broker: counts the messages the engine would publish."""

    def __init__(self) -> None:
        self.messages: Counter[str] = Counter()

    def dispatch_step(self, function: str, run_id: str, step_name: str) -> None:
        self.messages["step"] += 1

    def wake_run(self, run_id: str, countdown_s: float = 0.0) -> None:
        self.messages["orchestrate"] += 1

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        self.messages["timer"] += 1


def measure(steps: int, redis_url: str, mongo_url: str, *, in_place: bool = False
            ) -> dict[str, Any]:
    client, mongo = counting_mongo(mongo_url)
    redis_client = CountingRedis.from_url(redis_url)
    prefix = f"pikku-bench-{uuid.uuid4().hex[:8]}"
    pikku = PikkuCelery(Celery("bench", broker="memory://"),
                        store=MongoWorkflowStore(client[f"pikku_bench_{uuid.uuid4().hex[:8]}"]),
                        leases=RedisLeaseService(redis_client, key_prefix=prefix),
                        continue_in_place=in_place, worker_reaper=False)
    wakes = Wakes()
    pikku.engine.dispatcher = wakes

    @pikku.step(name="bench.noop")
    def noop(data: Any) -> Any:
        return data

    @pikku.workflow("bench")
    def bench(wf: Any, n: int) -> int:
        for i in range(n):
            wf.do(f"s{i}", noop, i)
        return n

    run_id = pikku.start(bench, steps)
    definition = pikku.registry.steps["bench.noop"]
    worker: dict[str, Counter[str]] = {"mongo": Counter(), "redis": Counter()}
    orchestrator: dict[str, Counter[str]] = {"mongo": Counter(), "redis": Counter()}
    for i in range(steps + 1):
        if i == 0 or not in_place:
            _count(mongo, redis_client, orchestrator, lambda: pikku.engine.advance(run_id))
        if i < steps:
            _count(mongo, redis_client, worker,
                   lambda i=i: pikku.engine.execute_step(definition, run_id, f"s{i}"))
    assert pikku.get_run(run_id).status == "completed"
    for key in redis_client.scan_iter(match=f"{prefix}:*"):
        redis_client.delete(key)
    client.drop_database(pikku.engine.store.db.name)  # type: ignore[attr-defined]
    return {"steps": steps, "worker": worker, "orchestrator": orchestrator,
            "messages": wakes.messages, "in_place": in_place}


def _count(mongo: Any, redis_client: Any, into: dict[str, Counter[str]], fn: Any) -> None:
    mongo.commands.clear()
    redis_client.commands.clear()
    fn()
    into["mongo"].update(mongo.commands)
    into["redis"].update(redis_client.commands)


def report(result: dict[str, Any]) -> str:
    n = result["steps"]
    mode = ("continue_in_place=True: the worker replays the run after each step"
            if result["in_place"] else "default: each step success sends an orchestrator message")
    lines = [f"step_cost: one workflow of {n} sequential steps, per step ({mode})"]
    for side in ("worker", "orchestrator"):
        for store in ("mongo", "redis"):
            counts = result[side][store]
            total = sum(counts.values()) / n
            detail = ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(counts.items()))
            lines.append(f"  {side:<12} {store:<5} {total:5.2f} commands/step  ({detail})")
    msgs = ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(result["messages"].items()))
    lines.append(f"  broker messages per step: {msgs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    with Stack() as stack:
        print(report(measure(args.steps, stack.redis_url, stack.mongo_url)))
        print()
        print(report(measure(args.steps, stack.redis_url, stack.mongo_url, in_place=True)))


if __name__ == "__main__":
    main()
