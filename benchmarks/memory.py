"""Memory of a worker: a bare Celery worker against the same app with pikku bound, threads
and prefork pools, after each has done some work (a few hundred tasks, or a few dozen
workflows of ten steps), measured interleaved and reported as medians.

    python -m benchmarks.memory [--rounds 3] [--concurrency 2]

Figures per worker: RSS of the main process and its pool children together, and PSS
(proportional set size: pages shared by a prefork parent and its children counted once,
split between them), which is what the machine really spends. The bare app is
``benchmarks.benchapp`` with ``BENCH_BARE=1``: the same module, broker and task, no pikku
(pikku's ``celery pikku`` entry point, which every ``celery`` command loads, imports no part
of pikku until its commands are used, so the bare worker is as if pikku were not installed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.target import describe
from benchmarks.throughput import BROKERS, forget, mode_env
from example_project.stack import Stack

KINDS = ("bare", "pikku")
POOLS = ("threads", "prefork")


def _tree_memory(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MB of ``pid`` and its children."""
    import psutil

    root = psutil.Process(pid)
    rss = pss = 0
    for proc in [root, *root.children(recursive=True)]:
        with open(f"/proc/{proc.pid}/smaps_rollup") as rollup:
            fields = dict(line.split(":", 1) for line in rollup if ":" in line)
        rss += int(fields["Rss"].split()[0])
        pss += int(fields["Pss"].split()[0])
    return rss / 1024, pss / 1024


def measure(kind: str, pool: str, concurrency: int) -> tuple[float, float]:
    env = {**os.environ, "BENCH_BARE": "1" if kind == "bare" else "0"}
    log = open(Path(tempfile.mkdtemp(prefix="pikku-mem-")) / "w.log", "wb")  # noqa: SIM115
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "benchmarks.benchapp", "worker", "-P", pool,
         "-c", str(concurrency), "-n", f"mem-{uuid.uuid4().hex[:6]}@%h", "--without-gossip",
         "--without-mingle", "--without-heartbeat", "--loglevel", "WARNING"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        from benchmarks import benchapp

        if kind == "bare":
            results = [benchapp.plain_noop.delay(i) for i in range(300)]
            for result in results:
                result.get(timeout=120, interval=0.01)
        else:
            run_ids = [benchapp.pikku.start("bench.sequence", 10) for _ in range(30)]
            for run_id in run_ids:
                assert benchapp.pikku.wait(run_id, 300).status == "completed"
        time.sleep(1.0)  # settle: threads started, pools warmed
        return _tree_memory(worker.pid)
    finally:
        worker.terminate()
        worker.wait(30)


def run_one(env: dict[str, str], kind: str, pool: str, concurrency: int) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--measure",
                          f"{kind},{pool}", "--concurrency", str(concurrency)], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} {pool} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    rss, pss = out.stdout.strip().splitlines()[-1].split()
    return float(rss), float(pss)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        kind, pool = args.measure.split(",")
        print(*measure(kind, pool, args.concurrency))
        return
    found: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with Stack() as stack:
        mongo = describe(stack.mongo_url)
        base: dict[str, Any] = {**os.environ, "BENCH_REDIS": stack.redis_url,
                                "BENCH_BROKER": BROKERS["redis"] or stack.redis_url}
        for r in range(args.rounds):
            for pool in POOLS:
                for kind in KINDS[r % 2:] + KINDS[:r % 2]:
                    env = mode_env(base, "plain" if kind == "bare" else "pikku",
                                   stack.mongo_url)
                    try:
                        found.setdefault((kind, pool), []).append(
                            run_one(env, kind, pool, args.concurrency))
                    finally:
                        forget(env)
    print(f"memory of one worker after some work, -c {args.concurrency}, {args.rounds} "
          f"rounds (median MB: RSS of the process tree, PSS), on {mongo}")
    for pool in POOLS:
        rss = {k: statistics.median(r for r, _ in found[(k, pool)]) for k in KINDS}
        pss = {k: statistics.median(p for _, p in found[(k, pool)]) for k in KINDS}
        print(f"  {pool:<8} bare RSS {rss['bare']:6.1f} PSS {pss['bare']:6.1f}; pikku RSS "
              f"{rss['pikku']:6.1f} PSS {pss['pikku']:6.1f}; extra RSS "
              f"{rss['pikku'] - rss['bare']:+5.1f}, PSS {pss['pikku'] - pss['bare']:+5.1f}")


if __name__ == "__main__":
    main()
