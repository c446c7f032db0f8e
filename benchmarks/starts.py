"""What starting a run costs, against what sending a Celery task costs (issue 34, item 4):
``pikku.start`` of a one-step workflow against ``apply_async`` of a plain task, on the
same broker, measured interleaved in one process; and the round trips of one start
(MongoDB commands and writes, Redis commands, broker messages), counted.

    python -m benchmarks.starts [--broker redis|amqp] [--starts 500] [--rounds 5] [--workers]

``recorded`` is the floor of a start that returns once its run is durable: one majority
insert of a small document, then the same ``apply_async``, with none of pikku's work.

No worker consumes: a start is what the caller (a web request) waits for, the message and
the run's insert. With ``--workers``, two ``celery -A benchmarks.benchapp`` workers (threads,
2 x 8) run what is sent meanwhile, as in production: the tasks, and the started workflows
(one step each) with their claims, settles and ends; the caller competes with them for the
cores, MongoDB and the broker, as the issue measured it.

The store is the one users get (``MongoWorkflowStore.from_url``: majority writes, 10 s
``wtimeout``) on the MongoDB of ``benchmarks.target``. The messages
are deleted afterwards with their queue, as are the Redis keys.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from typing import Any

from celery import Celery

from benchmarks import throughput
from benchmarks.target import counting_store, describe
from example_project.stack import Stack
from pikku_celery import PikkuCelery, RedisLeaseService
from tests.support.counting import CountingRedis, MongoCommands

WRITES = ("insert", "update", "delete", "findAndModify")


class Starter:
    """A Celery app with a plain task and a pikku bound to it, publishing to a queue of
    its own, counting what it sends."""

    def __init__(self, broker_url: str, redis_url: str, mongo_url: str) -> None:
        tag = uuid.uuid4().hex[:8]
        self.queue = f"pikku-starts-{tag}"
        self.app = Celery(f"starts-{tag}", broker=broker_url)
        self.app.conf.update(task_default_queue=self.queue, broker_heartbeat=0,
                             broker_connection_retry_on_startup=True)
        self.mongo = MongoCommands()
        self.store = counting_store(mongo_url, f"pikku_starts_{tag}", [self.mongo])
        self.redis = CountingRedis.from_url(redis_url)
        self.prefix = f"pikku-starts-{tag}"
        self.pikku = PikkuCelery(self.app, store=self.store,
                                 leases=RedisLeaseService(self.redis, key_prefix=self.prefix),
                                 worker_reaper=False)
        self.messages: Counter[str] = Counter()

        @self.app.task(name="starts.plain")
        def plain(x: Any) -> Any:
            return x

        @self.pikku.step(name="starts.step")
        def step(x: Any) -> Any:
            return x

        @self.pikku.workflow("starts.one")
        def one(wf: Any, n: int) -> Any:
            return wf.do("only", step, n)

        self.plain = plain
        from celery.signals import before_task_publish

        before_task_publish.connect(self._count, weak=False)

    def _count(self, sender: Any = None, **kwargs: Any) -> None:
        self.messages[str(sender)] += 1

    def per_call_ms(self, what: str, count: int) -> float:
        """Milliseconds per call of ``apply_async``, ``start``, or ``start-before``: a start
        as it was before issue 34 (the definition's source inserted again on every start,
        failing on its duplicate key), for a before/after measured side by side."""
        versions = self.pikku.engine.runs._versions_recorded

        def start_before(i: int) -> None:
            versions.clear()
            self.pikku.start("starts.one", i)

        def recorded(i: int) -> None:
            floor.insert_one({"i": i})
            self.plain.apply_async((i,))

        from pymongo import WriteConcern

        floor = self.store.db.get_collection("floor_starts",
                                             write_concern=WriteConcern("majority"))
        call = {"apply_async": lambda i: self.plain.apply_async((i,)),
                "recorded": recorded,
                "start": lambda i: self.pikku.start("starts.one", i),
                "start-before": start_before}[what]
        call(-1)  # connections and the first start's one-time work out of the measure
        started = time.perf_counter()
        for i in range(count):
            call(i)
        return (time.perf_counter() - started) * 1000 / count

    def counts_per_start(self, count: int) -> dict[str, float]:
        """Round trips per start, after a first start (the indexes, the definition's
        source: once per process)."""
        self.pikku.start("starts.one", -2)
        self.mongo.clear()
        self.redis.commands.clear()
        self.messages.clear()
        for i in range(count):
            self.pikku.start("starts.one", i)
        commands = self.mongo.commands
        return {"mongo": sum(commands.values()) / count,
                "mongo writes": sum(commands[name] for name in WRITES) / count,
                "redis": sum(self.redis.commands.values()) / count,
                "messages": sum(self.messages.values()) / count}

    def close(self) -> None:
        from celery.signals import before_task_publish

        before_task_publish.disconnect(self._count)
        with self.app.connection_for_write() as conn:
            conn.default_channel.queue_delete(self.queue)
        doomed = list(self.redis.scan_iter(match=f"{self.prefix}:*", count=1000))
        if doomed:
            self.redis.delete(*doomed)
        self.store.db.client.drop_database(self.store.db.name)


def with_workers(starts: int, rounds: int) -> dict[str, list[float]]:
    """Milliseconds per call of ``apply_async`` and of ``start``, rounds interleaved, while
    two fresh workers run what they send (in a process of its own: ``benchapp`` is
    configured by the environment ``throughput.mode_env`` made)."""
    import shutil
    import tempfile
    from pathlib import Path

    from benchmarks import benchapp

    logdir = Path(tempfile.mkdtemp(prefix="pikku-bench-"))
    procs = throughput.start_workers(dict(os.environ), 2, logdir)
    floor = benchapp._claims().database["floor_starts"]

    def recorded(i: int) -> None:
        floor.insert_one({"i": i})
        benchapp.plain_noop.apply_async((i,))

    calls = {"apply_async": lambda i: benchapp.plain_noop.apply_async((i,)),
             "recorded": recorded,
             "start": lambda i: benchapp.pikku.start("bench.sequence", 1)}
    found: dict[str, list[float]] = {mode: [] for mode in calls}
    try:
        throughput.wait_ready(benchapp.pikku)
        for r in range(rounds):
            modes = list(calls)
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                call = calls[mode]
                started = time.perf_counter()
                for i in range(starts):
                    call(i)
                found[mode].append((time.perf_counter() - started) * 1000 / starts)
        return found
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(20)
        shutil.rmtree(logdir, ignore_errors=True)


def main_with_workers(broker: str, starts: int, rounds: int) -> None:
    with Stack() as stack:
        base: dict[str, Any] = {**os.environ, "BENCH_REDIS": stack.redis_url,
                                "BENCH_BROKER": throughput.BROKERS[broker] or stack.redis_url}
        env = throughput.mode_env(base, "pikku", stack.mongo_url)
        try:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.starts", "--measure", "--starts",
                 str(starts), "--rounds", str(rounds)], env=env, capture_output=True,
                text=True, timeout=1800)
            if out.returncode != 0:
                raise RuntimeError(f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
            found = json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            throughput.forget(env)
        print(f"{starts} calls per mode on {broker} while two workers (2 x 8 threads) run "
              f"them, {rounds} rounds interleaved (median, range), on {describe(stack.mongo_url)}:")
        for mode, values in found.items():
            print(f"  {mode:<13} {statistics.median(values):6.2f} ms "
                  f"({min(values):.2f}-{max(values):.2f})")
        for mode in ("recorded", "start"):
            ratios = [a / b for a, b in zip(found[mode], found["apply_async"], strict=True)]
            print(f"  {mode} / apply_async  x{statistics.median(ratios):.2f}; round by round: "
                  + " ".join(f"x{r:.2f}" for r in ratios))
        print(f"  load average at the end {throughput._load()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=sorted(throughput.BROKERS), default="redis")
    parser.add_argument("--starts", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", action="store_true",
                        help="two workers run what the calls send, meanwhile")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:  # the process --workers measures in
        print(json.dumps(with_workers(args.starts, args.rounds)))
        return 0
    if args.workers:
        main_with_workers(args.broker, args.starts, args.rounds)
        return 0
    with Stack() as stack:
        print(f"starts on {describe(stack.mongo_url)}")
        broker = (stack.redis_url if args.broker == "redis"
                  else throughput.BROKERS[args.broker])
        starter = Starter(broker, stack.redis_url, stack.mongo_url)
        try:
            counts = starter.counts_per_start(50)
            print("round trips per start (50 starts after the first): " + "; ".join(
                f"{name} {value:.2f}" for name, value in counts.items()))
            print(f"  MongoDB commands by name: {dict(starter.mongo.commands)}")
            modes = ("apply_async", "recorded", "start", "start-before")
            found: dict[str, list[float]] = {mode: [] for mode in modes}
            for _ in range(args.rounds):
                for mode in modes:
                    found[mode].append(starter.per_call_ms(mode, args.starts))
            print(f"{args.starts} calls per mode on {args.broker}, {args.rounds} rounds "
                  f"interleaved (median, range):")
            for mode in modes:
                values = found[mode]
                print(f"  {mode:<13} {statistics.median(values):6.2f} ms "
                      f"({min(values):.2f}-{max(values):.2f})")
            for mode in modes[1:]:
                ratios = [a / b for a, b in zip(found[mode], found["apply_async"], strict=True)]
                print(f"  {mode} / apply_async  x{statistics.median(ratios):.2f}; round by "
                      "round: " + " ".join(f"x{r:.2f}" for r in ratios))
            print(f"  load average at the end {throughput._load()}")
        finally:
            starter.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
