"""The DBOS side of ``benchmarks.peer_dbos``: run by DBOS Transact's own virtualenv's Python
(never by the project's), it measures one round on the PostgreSQL it is given and prints
one JSON object on its last line of output.

    <dbos-venv>/bin/python benchmarks/_dbos_side.py --url postgresql://... [--steps 10]
        [--runs 30] [--workflows 30] [--poll 0.1]

In one process (what DBOS calls its library mode: the workflow runs in the caller's
thread, every step's output committed to PostgreSQL before the next step runs):

``latency``        milliseconds of each of ``--runs`` calls of a workflow of ``--steps``
                   steps, called directly (end to end: the workflow's status row, each
                   step's output, the workflow's result); ``cpu_ms_per_step``: this
                   process's CPU over those calls, per step (no queue registered yet);
``queue_latency``  the same workflow enqueued on a ``Queue`` and waited on (the queue's
                   poller, ``--poll`` seconds apart, dequeues it; ``get_result`` polls
                   every 2 ms);
``inproc``         steps per second of ``--workflows`` workflows started at once with
                   ``DBOS.start_workflow`` (DBOS's thread pool runs them in this process);
``queue``          steps per second of ``--workflows`` workflows enqueued at once on the
                   queue (no concurrency limit: each poll dequeues what is there).

Each step does trivial work (returns its input + 1), so what is measured is the engine's
own overhead and its database's commits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import version
from typing import Any

WARM_RUNS = 3
RESULT_POLL_S = 0.002


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the system database's URL")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--queue-runs", type=int, default=10)
    parser.add_argument("--workflows", type=int, default=30)
    parser.add_argument("--poll", type=float, default=0.1,
                        help="the queue's polling interval (DBOS's default is 1 s)")
    args = parser.parse_args(argv)

    from dbos import DBOS

    @DBOS.step()
    def add_one(x: int) -> int:
        return x + 1

    @DBOS.workflow()
    def sequence(n: int) -> int:
        x = 0
        for _ in range(n):
            x = add_one(x)
        return x

    DBOS(config={"name": "pikku-bench", "system_database_url": args.url,
                 "log_level": "WARNING"})
    DBOS.launch()
    found: dict[str, Any] = {"version": version("dbos"), "steps": args.steps,
                             "poll_s": args.poll}
    try:
        for _ in range(WARM_RUNS):  # connections, the first statements' plans
            assert sequence(args.steps) == args.steps
        found["latency"] = []
        cpu = time.process_time()
        for _ in range(args.runs):
            started = time.perf_counter()
            assert sequence(args.steps) == args.steps
            found["latency"].append((time.perf_counter() - started) * 1000)
        found["cpu_ms_per_step"] = ((time.process_time() - cpu) * 1000
                                    / (args.runs * args.steps))

        # Registered after the direct calls, so that its poller does not run beside them.
        queue = DBOS.register_queue("pikku_bench", polling_interval_sec=args.poll)
        found["queue_latency"] = []
        queue.enqueue(sequence, args.steps).get_result(polling_interval_sec=RESULT_POLL_S)
        for _ in range(args.queue_runs):
            started = time.perf_counter()
            handle = queue.enqueue(sequence, args.steps)
            assert handle.get_result(polling_interval_sec=RESULT_POLL_S) == args.steps
            found["queue_latency"].append((time.perf_counter() - started) * 1000)

        started = time.perf_counter()
        handles = [DBOS.start_workflow(sequence, args.steps) for _ in range(args.workflows)]
        for h in handles:
            assert h.get_result() == args.steps
        found["inproc"] = args.workflows * args.steps / (time.perf_counter() - started)

        started = time.perf_counter()
        handles = [queue.enqueue(sequence, args.steps) for _ in range(args.workflows)]
        for h in handles:
            assert h.get_result(polling_interval_sec=RESULT_POLL_S) == args.steps
        found["queue"] = args.workflows * args.steps / (time.perf_counter() - started)
    finally:
        DBOS.destroy()
    sys.stdout.write(json.dumps(found) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
