"""Throughput on real ``celery -A`` workers: plain Celery no-op tasks against pikku steps on
the same broker, in one run, reported as a ratio (machines are noisy; ratios less so).

    python -m benchmarks.throughput [--broker redis|amqp] [--tasks 600] [--steps 10]

Plain Celery: ``--tasks`` no-op tasks with a Redis result backend, all sent at once.
pikku: ``--tasks / --steps`` workflows of ``--steps`` sequential no-op steps, all started at
once, each step fenced (claim, lease, heartbeat, settle, history) on MongoDB (or the
nx-27017 stand-in) and Redis; then the same with ``continue_in_place=True``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from example_project.stack import Stack

BROKERS = {"redis": None, "amqp": "amqp://guest:guest@127.0.0.1:5672//"}


def start_workers(env: dict[str, str], count: int, logdir: Path) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(count):
        log = open(logdir / f"w{i}.log", "wb")  # noqa: SIM115 - lives with the process
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "benchmarks.benchapp", "worker", "-P",
             "threads", "-c", "8", "-n", f"bench{i}-{uuid.uuid4().hex[:6]}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat",
             "--loglevel", "WARNING"], stdout=log, stderr=subprocess.STDOUT, env=env))
    time.sleep(3)
    return procs


def run_mode(env: dict[str, str], mode: str, tasks: int, steps: int) -> float:
    """Units (tasks or steps) per second for one mode, measured in a fresh process with
    fresh workers, so no mode inherits another's app, connections or queues."""
    env = {**env, "BENCH_IN_PLACE": "1" if mode == "pikku-in-place" else "0",
           "BENCH_QUEUE": f"bench-{uuid.uuid4().hex[:8]}",
           "BENCH_PREFIX": f"bench-{uuid.uuid4().hex[:8]}"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.throughput", "--measure", mode, "--tasks",
         str(tasks), "--steps", str(steps)], env=env, capture_output=True, text=True,
        timeout=900, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def measure(mode: str, tasks: int, steps: int) -> float:
    logdir = Path(tempfile.mkdtemp(prefix="pikku-bench-"))
    env = dict(os.environ)
    from benchmarks import benchapp

    procs = start_workers(env, 2, logdir)
    try:
        started = time.perf_counter()
        if mode == "plain":
            results = [benchapp.plain_noop.delay(i) for i in range(tasks)]
            for result in results:
                result.get(timeout=300, interval=0.01)
            for result in results:
                result.forget()  # leave nothing behind in a Redis others use
            units = tasks
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
        _forget(env)


def _forget(env: dict[str, str]) -> None:
    """Delete this measurement's lease keys and queue from the shared Redis."""
    import redis

    client = redis.Redis.from_url(env["BENCH_REDIS"])
    doomed = list(client.scan_iter(match=f"{env['BENCH_PREFIX']}:*", count=1000))
    doomed += list(client.scan_iter(match=f"{env['BENCH_QUEUE']}*", count=1000))
    if doomed:
        client.delete(*doomed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=sorted(BROKERS), default="redis")
    parser.add_argument("--tasks", type=int, default=600)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(measure(args.measure, args.tasks, args.steps))
        return
    with Stack() as stack:
        env: dict[str, Any] = {**os.environ, "BENCH_REDIS": stack.redis_url,
                               "BENCH_BACKEND": stack.redis_url,
                               "BENCH_MONGO": stack.mongo_url.replace(
                                   "/pikku_demo", f"/bench_{uuid.uuid4().hex[:6]}"),
                               "BENCH_BROKER": BROKERS[args.broker] or stack.redis_url}
        rates = {mode: run_mode(env, mode, args.tasks, args.steps)
                 for mode in ("plain", "pikku", "pikku-in-place")}
    base = rates["plain"]
    print(f"throughput on {args.broker}, 2 workers x 8 threads, {args.tasks} units per mode")
    for mode, rate in rates.items():
        unit = "tasks" if mode == "plain" else "steps"
        print(f"  {mode:<15} {rate:8.1f} {unit}/s   ratio to plain Celery {rate / base:5.2f}")


if __name__ == "__main__":
    main()
