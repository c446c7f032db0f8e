"""Throughput on real ``celery -A`` workers: pikku workflows against Celery's own ways of
running the same work, on the same broker, pool and MongoDB, measured interleaved in one
run and reported as medians and ratios (machines are noisy; ratios less so).

    python -m benchmarks.throughput [--broker redis|amqp] [--tasks 300] [--steps 10]
                                    [--rounds 3] [--modes chain,pikku,...]
                                    [--time-limit SECONDS] [--pool threads|prefork]

Modes (each measured with two fresh workers, 2 x 8 threads, or 2 x 8 prefork children
with ``--pool prefork``, which enforces time limits where threads do not; in a fresh
process each):

``plain``           ``--tasks`` no-op tasks sent at once, results in Redis;
``chain``           ``--tasks / --steps`` Celery chains of ``--steps`` no-op tasks, results
                    in Celery's MongoDB result backend (the MongoDB the workflows use): the
                    comparator for durable sequential work;
``chain-claimed``   the same chains of tasks that each make one guarded majority update
                    before returning (``bench.claimed_noop``): two majority writes per
                    task, the claim and the result, as any durably claimed step makes;
                    the floor of a sent step, with none of pikku's leases, replay or
                    fencing;
``chain-leased``    the same with the Redis round trips pikku's contract adds to a step
                    (``bench.leased_noop``: the step lease, the run lease taken and given
                    back): the floor of a sent step under that contract;
``pikku``           ``--tasks / --steps`` workflows of ``--steps`` sequential no-op steps,
                    every step claimed, fenced and recorded in MongoDB, leases in Redis,
                    the defaults: steps run in place, up to 100 in a row, in the task of
                    the message that started the run;
``pikku-sent``      the same with ``in_place_steps=0``: every step sent as a task of its
                    own, the run passed after each (the default before issue 24);
``pikku-messages``  the same with ``continue_in_place=False`` (one orchestrator message per
                    settle).

Each measurement deletes what it left in Redis, its queue on RabbitMQ and its database.
The MongoDB is a real ``mongod`` single-node replica set unless ``PIKKU_MONGO_URL`` says
otherwise (``benchmarks.target``; the last line printed names it). On MongoDB 5.0 and later
a replica set's default write concern is ``majority``, so Celery's MongoDB result backend
(which sets none) writes with ``majority`` too, as pikku's store does by default.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.target import database_url, describe
from example_project.stack import Stack

BROKERS = {"redis": None, "amqp": "amqp://guest:guest@127.0.0.1:5672//"}
MODES = ("plain", "chain", "chain-claimed", "chain-leased", "pikku", "pikku-sent", "pikku-messages")


def start_workers(env: dict[str, str], count: int, logdir: Path,
                  app: str = "benchmarks.benchapp") -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(count):
        log = open(logdir / f"w{i}.log", "wb")  # noqa: SIM115 - lives with the process
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", app, "worker", "-P",
             env.get("BENCH_POOL", "threads"), "-c", "8",
             "-n", f"bench{i}-{uuid.uuid4().hex[:6]}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat",
             "--loglevel", "WARNING"], stdout=log, stderr=subprocess.STDOUT, env=env))
    return procs


def wait_ready(pikku: Any, timeout_s: float = 60.0) -> None:
    """Until the workers consume: a one-step workflow runs to its end (every mode has pikku
    bound; not every mode has a result backend to ping through)."""
    run_id = pikku.start("bench.sequence", 1)
    pikku.wait(run_id, timeout_s)


def mode_env(env: dict[str, Any], mode: str, mongo_base: str) -> dict[str, str]:
    """The environment of one measurement: its own queue, key prefix and database."""
    tag = uuid.uuid4().hex[:8]
    database = f"bench_{tag}"
    mongo = database_url(mongo_base, database)
    backend = {"plain": env["BENCH_REDIS"], "chain": mongo, "chain-claimed": mongo,
               "chain-leased": mongo}.get(mode, "")
    return {**env, "BENCH_IN_PLACE": "0" if mode == "pikku-messages" else "1",
            "BENCH_IN_PLACE_STEPS": "0" if mode in ("pikku-sent", "pikku-messages") else "100",
            "BENCH_QUEUE": f"bench-{tag}", "BENCH_PREFIX": f"bench-{tag}",
            "BENCH_MONGO": mongo, "BENCH_BACKEND": backend, "BENCH_DATABASE": database}


def run_mode(env: dict[str, str], mode: str, tasks: int, steps: int) -> float:
    """Units (tasks or steps) per second for one mode, measured in a fresh process with
    fresh workers, so no mode inherits another's app, connections or queues."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.throughput", "--measure", mode, "--tasks",
         str(tasks), "--steps", str(steps)], env=env, capture_output=True, text=True,
        timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def measure(mode: str, tasks: int, steps: int, app: str = "benchmarks.benchapp") -> float:
    """Units per second of one mode on two fresh workers of ``app`` (a module with
    ``pikku``, ``plain_noop`` and the ``bench.sequence`` workflow, as ``benchapp``)."""
    import importlib

    logdir = Path(tempfile.mkdtemp(prefix="pikku-bench-"))
    env = dict(os.environ)
    from celery import chain

    benchapp = importlib.import_module(app)
    procs = start_workers(env, 2, logdir, app)
    try:
        wait_ready(benchapp.pikku)
        started = time.perf_counter()
        if mode == "plain":
            results = [benchapp.plain_noop.delay(i) for i in range(tasks)]
            for result in results:
                result.get(timeout=300, interval=0.01)
            for result in results:
                result.forget()
            units = tasks
        elif mode.startswith("chain"):
            noop = {"chain": benchapp.plain_noop, "chain-claimed": benchapp.claimed_noop,
                    "chain-leased": benchapp.leased_noop}[mode]
            results = [chain(noop.s(0), *(noop.s() for _ in range(steps - 1))).apply_async()
                       for _ in range(tasks // steps)]
            for result in results:
                result.get(timeout=300, interval=0.01)
            units = len(results) * steps
        else:
            run_ids = [benchapp.pikku.start("bench.sequence", steps)
                       for _ in range(tasks // steps)]
            for run_id in run_ids:
                assert benchapp.pikku.wait(run_id, 600).status == "completed"
            units = len(run_ids) * steps
        return units / (time.perf_counter() - started)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(20)
        forget(env)
        shutil.rmtree(logdir, ignore_errors=True)  # the workers' logs, not kept


def forget(env: dict[str, str]) -> None:
    """Delete what one measurement left: its Redis keys, its queue, its database."""
    import pymongo
    import redis
    from kombu import Connection

    client = redis.Redis.from_url(env["BENCH_REDIS"])
    doomed = list(client.scan_iter(match=f"{env['BENCH_PREFIX']}:*", count=1000))
    doomed += list(client.scan_iter(match=f"{env['BENCH_QUEUE']}*", count=1000))
    doomed += list(client.scan_iter(match="celery-task-meta-*", count=1000))
    if doomed:
        client.delete(*doomed)
    if env["BENCH_BROKER"].startswith("amqp"):
        with Connection(env["BENCH_BROKER"]) as conn:
            channel = conn.default_channel
            channel.queue_delete(env["BENCH_QUEUE"])
    mongo: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(env["BENCH_MONGO"])
    mongo.drop_database(env["BENCH_DATABASE"])
    mongo.close()


def interleaved(env: dict[str, Any], mongo_base: str, modes: list[str], rounds: int,
                tasks: int, steps: int) -> dict[str, list[float]]:
    """Every mode once per round, the order rotating, so drift hits all modes alike."""
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            rates[mode].append(run_mode(mode_env(env, mode, mongo_base), mode, tasks, steps))
    return rates


def report(broker: str, tasks: int, steps: int, rates: dict[str, list[float]]) -> str:
    medians = {mode: statistics.median(values) for mode, values in rates.items()}
    base = medians.get("chain") or next(iter(medians.values()))
    pool = os.environ.get("BENCH_POOL", "threads")
    lines = [f"throughput on {broker}, 2 workers x 8 {pool}, {tasks} units per mode, "
             f"{steps} per chain or workflow, {len(next(iter(rates.values())))} rounds "
             "(median, range)"]
    for mode, median in medians.items():
        unit = "steps" if mode.startswith("pikku") else "tasks"
        spread = f"{min(rates[mode]):.0f}-{max(rates[mode]):.0f}"
        ratio = f"x{median / base:4.2f} of chain" if "chain" in medians else ""
        lines.append(f"  {mode:<15} {median:7.1f} {unit}/s ({spread})  {ratio}")
    if "chain" in rates:
        # Round r measured every mode back to back: its own ratios drift least with the load.
        for mode in rates:
            if mode != "chain":
                each = " ".join(f"x{a / b:4.2f}" for a, b in zip(rates[mode], rates["chain"],
                                                                 strict=True))
                lines.append(f"  {mode:<15} of chain, round by round: {each}")
    for floor in ("chain-claimed", "chain-leased"):
        # The floors of a claimed step: how far pikku's own work (replay, notes, fencing)
        # puts it below the writes (and leases) any durably claimed step makes.
        if floor in medians:
            lines += [f"  {mode:<15} x{median / medians[floor]:4.2f} of {floor}"
                      for mode, median in medians.items() if mode.startswith("pikku")]
    return "\n".join(lines)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=sorted(BROKERS), default="redis")
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--time-limit", type=float, default=None,
                        help="an app-wide task_time_limit for every mode (seconds)")
    parser.add_argument("--pool", choices=("threads", "prefork"), default="threads",
                        help="the workers' pool (prefork enforces time limits)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ["BENCH_POOL"] = args.pool
    if args.measure:
        print(measure(args.measure, args.tasks, args.steps))
        return
    with Stack() as stack:
        env: dict[str, Any] = {**os.environ, "BENCH_REDIS": stack.redis_url,
                               "BENCH_BROKER": BROKERS[args.broker] or stack.redis_url}
        if args.time_limit:
            env["BENCH_TIME_LIMIT"] = str(args.time_limit)
        mongo = describe(stack.mongo_url)
        rates = interleaved(env, stack.mongo_url, args.modes.split(","), args.rounds,
                            args.tasks, args.steps)
    print(report(args.broker, args.tasks, args.steps, rates))
    if args.time_limit:
        print(f"  every mode with task_time_limit={args.time_limit:g} ({args.pool} pool)")
    print(f"  on {mongo}; load average at the end {_load()}")


if __name__ == "__main__":
    main()
