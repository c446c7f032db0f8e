"""Fan-out and join on real ``celery -A`` workers: ``wf.gather`` over N calls against a
Celery chord of N no-op tasks and a group joined by the client, on the same broker, pool
and MongoDB (Celery's MongoDB result backend for the chord and the group), interleaved,
medians reported. Also counts what each worker executed (``task_prerun``), so the
orchestrator messages of a fan-out are a figure, not a guess.

    python -m benchmarks.fanout [--broker redis|amqp] [--sizes 10,100,500,2000] [--rounds 2]

Modes: ``pikku`` (``continue_in_place``, the default), ``pikku-messages`` (a message per
settle), ``chord`` (``chord(group)(join)``: with the MongoDB backend Celery joins by
polling with ``celery.chord_unlock``), ``chord-claimed`` (the same chord of tasks that each
make one guarded majority update first, ``bench.claimed_noop``: the floor of a fan-out whose
calls are claimed and recorded durably, two majority writes per call), ``chord-leased``
(with the Redis round trips pikku's contract adds: ``bench.leased_noop``), ``group``
(``group(...)`` and ``GroupResult.join`` in the client). Each measurement has fresh
workers, queue, key prefix and database. The MongoDB is a real ``mongod`` single-node
replica set unless ``PIKKU_MONGO_URL`` says otherwise; the last line printed names it
(``benchmarks.target``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.target import describe
from benchmarks.throughput import BROKERS, forget, mode_env, start_workers, wait_ready
from example_project.stack import Stack

MODES = ("pikku", "pikku-messages", "chord", "chord-claimed", "chord-leased", "group")


def run_mode(env: dict[str, str], mode: str, size: int) -> tuple[float, dict[str, int]]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.fanout", "--measure", mode,
                          "--sizes", str(size)], env=env, capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} {size} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    seconds, *counts = out.stdout.strip().splitlines()[-1].split()
    return float(seconds), {k: int(v) for k, v in (c.split("=") for c in counts)}


def measure(mode: str, size: int) -> tuple[float, dict[str, int]]:
    import redis
    from celery import chord, group

    from benchmarks import benchapp

    env = dict(os.environ)
    procs = start_workers(env, 2, Path(tempfile.mkdtemp(prefix="pikku-fanout-")))
    counter = redis.Redis.from_url(env["BENCH_REDIS"])
    try:
        wait_ready(benchapp.pikku)
        counter.delete(env["BENCH_COUNTS"])
        started = time.perf_counter()
        noop = benchapp.plain_noop
        if mode.startswith("chord"):
            task = {"chord": noop, "chord-claimed": benchapp.claimed_noop,
                    "chord-leased": benchapp.leased_noop}[mode]
            assert chord(group(task.s(i) for i in range(size)))(
                benchapp.join.s()).get(timeout=1200, interval=0.01) == size
        elif mode == "group":
            assert len(group(noop.s(i) for i in range(size)).apply_async().join(
                timeout=1200, interval=0.01)) == size
        else:
            run_id = benchapp.pikku.start("bench.fanout", size)
            run = benchapp.pikku.wait(run_id, 1200)
            assert run.status == "completed" and run.output == size, run
        seconds = time.perf_counter() - started
        time.sleep(0.5)  # executions still being counted (a chord_unlock, a last wake)
        counts = {k.decode(): int(v) for k, v in counter.hgetall(env["BENCH_COUNTS"]).items()}
        return seconds, counts
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(20)
        counter.delete(env["BENCH_COUNTS"])
        forget(env)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=sorted(BROKERS), default="redis")
    parser.add_argument("--sizes", default="10,100,500,2000")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.measure:
        seconds, counts = measure(args.measure, sizes[0])
        print(seconds, *(f"{k}={v}" for k, v in sorted(counts.items())))
        return
    modes = args.modes.split(",")
    found: dict[tuple[str, int], list[tuple[float, dict[str, int]]]] = {}
    with Stack() as stack:
        mongo = describe(stack.mongo_url)
        env: dict[str, Any] = {**os.environ, "BENCH_REDIS": stack.redis_url,
                               "BENCH_BROKER": BROKERS[args.broker] or stack.redis_url}
        for r in range(args.rounds):
            for size in sizes:
                for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                    menv = mode_env(env, "chain" if mode.startswith(("chord", "group"))
                                    else mode,
                                    stack.mongo_url)
                    menv["BENCH_COUNTS"] = f"{menv['BENCH_PREFIX']}:counts"
                    found.setdefault((mode, size), []).append(run_mode(menv, mode, size))
    print(f"fan-out on {args.broker}, 2 workers x 8 threads, {args.rounds} rounds "
          "(median seconds; executions and messages sent in the last round, by task)")
    for size in sizes:
        base = statistics.median(s for s, _ in found[("chord", size)]) if (
            "chord" in modes) else None
        for mode in modes:
            seconds = statistics.median(s for s, _ in found[(mode, size)])
            counts = found[(mode, size)][-1][1]
            ratio = f"x{seconds / base:4.2f} of chord" if base else ""
            shown = ", ".join(f"{k.replace('bench.', '')} {v}" for k, v in sorted(
                counts.items()) if "bench.step" not in k and "plain_noop" not in k)
            print(f"  N={size:<5} {mode:<15} {seconds:7.2f} s  {ratio}  {shown}")
            if base and mode != "chord":
                # Each round measured every mode of a size back to back.
                each = " ".join(f"x{s / c:4.2f}" for (s, _), (c, _) in zip(
                    found[(mode, size)], found[("chord", size)], strict=True))
                print(f"          {mode} of chord, round by round: {each}")
        for floor in ("chord-claimed", "chord-leased"):
            # The floors of a claimed call: how far pikku's own work puts it above the
            # writes (and leases) any durably claimed call makes.
            if floor in modes:
                low = statistics.median(s for s, _ in found[(floor, size)])
                for mode in (m for m in modes if m.startswith("pikku")):
                    seconds = statistics.median(s for s, _ in found[(mode, size)])
                    print(f"          {mode} x{seconds / low:4.2f} of {floor}")
    print(f"  on {mongo}; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
