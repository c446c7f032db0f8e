"""The cost of observability (issue 33): throughput of 10-step workflows on real workers
with OpenTelemetry tracing and Prometheus metrics on against off, and against Celery chains
of 10 tasks with metrics on, measured interleaved in one run (medians and ratios, as
``benchmarks.throughput``); and the MongoDB and Redis commands per step with both on and
off (counts, as ``benchmarks.step_cost``: they must not change), and pikku's own CPU per
step with them off and on (no servers: what they add to the work itself).

    python -m benchmarks.observability [--broker redis|amqp] [--tasks 300] [--steps 10]
                                       [--rounds 3] [--short]

Throughput modes (each with two fresh workers, threads pool 2 x 8, in a fresh process,
``benchmarks.obsapp``): ``chain`` (Celery chains, pikku bound with metrics on),
``pikku-off`` (tracing and metrics off; the log lines and error reports, which need no
library, on), ``pikku-metrics`` (metrics), ``pikku-on`` (metrics and
tracing: the OpenTelemetry SDK with a batch processor and an exporter that drops spans).
``--short``: 100 steps per mode, one round, for CI (figures are rougher).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from typing import Any

from benchmarks import throughput
from benchmarks.target import describe
from example_project.stack import Stack

MODES = ("chain", "pikku-off", "pikku-metrics", "pikku-on")
OBSERVE = {"chain": "metrics", "pikku-off": "off", "pikku-metrics": "metrics",
           "pikku-on": "on"}


def measure(mode: str, tasks: int, steps: int) -> float:
    """Units per second of one mode (run in a fresh process: ``--measure``)."""
    return throughput.measure(mode, tasks, steps, app="benchmarks.obsapp")


def run_mode(env: dict[str, str], mode: str, tasks: int, steps: int) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.observability", "--measure", mode, "--tasks",
         str(tasks), "--steps", str(steps)], env=env, capture_output=True, text=True,
        timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def interleaved(env: dict[str, Any], mongo_base: str, rounds: int, tasks: int,
                steps: int) -> dict[str, list[float]]:
    """Every mode once per round, the order rotating, so drift hits all modes alike."""
    modes = list(MODES)
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    for r in range(rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            base = throughput.mode_env(env, "chain" if mode == "chain" else "pikku",
                                       mongo_base)
            rates[mode].append(run_mode({**base, "BENCH_OBSERVE": OBSERVE[mode]}, mode,
                                        tasks, steps))
    return rates


def ratios(rates: dict[str, list[float]]) -> str:
    """Round by round (each round measured every mode back to back) and of the medians."""
    import statistics

    medians = {mode: statistics.median(values) for mode, values in rates.items()}
    lines = []
    for name, top, bottom in (("on / off", "pikku-on", "pikku-off"),
                              ("metrics / off", "pikku-metrics", "pikku-off"),
                              ("on / chain", "pikku-on", "chain"),
                              ("metrics / chain", "pikku-metrics", "chain"),
                              ("off / chain", "pikku-off", "chain")):
        each = " ".join(f"x{a / b:4.2f}" for a, b in zip(rates[top], rates[bottom],
                                                          strict=True))
        lines.append(f"  {name:<16} x{medians[top] / medians[bottom]:4.2f} of the medians; "
                     f"round by round: {each}")
    return "\n".join(lines)


def commands(redis_url: str, mongo_url: str, steps: int) -> str:
    """MongoDB and Redis commands per step of a sequential run in place, observers off then
    on (metrics and tracing, spans kept in memory to count them): ``step_cost``'s count."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from benchmarks import step_cost
    from pikku_celery import observe

    real = observe.install
    observe.install = lambda pikku: []  # type: ignore[assignment]  # no observer at all
    try:
        off = step_cost.measure("sequential", steps, redis_url, mongo_url, in_place=True)
    finally:
        observe.install = real  # type: ignore[assignment]
    from benchmarks.observers import sdk_provider

    spans = InMemorySpanExporter()
    sdk_provider().add_span_processor(SimpleSpanProcessor(spans))
    on = step_cost.measure("sequential", steps, redis_url, mongo_url, in_place=True)
    lines = [f"commands per step, {steps} sequential steps run in place (step_cost):"]
    for name, result in (("observers off", off), ("tracing + metrics", on)):
        lines.append(f"  {name:<18} mongo {result.per_step(None, 'mongo'):5.2f}; redis "
                     f"{result.per_step(None, 'redis'):5.2f}; documents "
                     f"{result.per_step(None, 'documents'):5.2f}")
    lines.append(f"  ({len(spans.get_finished_spans())} spans recorded with tracing on)")
    return "\n".join(lines)


def _parts_without(*left_out: str) -> tuple[str, ...]:
    """``observe.PARTS`` without ``left_out``: the log lines, error reports and task events
    need no library, so a user has them whatever else is off."""
    from pikku_celery import observe

    return tuple(part for part in observe.PARTS if part not in left_out)


def cpu(steps: int, rounds: int) -> str:
    """pikku's own CPU per step with no driver (in-memory store and leases, the inline
    driver): observers off, metrics, metrics and tracing (the SDK with a batch processor
    and an exporter that drops the spans). The throughput above is mostly waiting on the
    servers; this is what the observers add to the work itself, best of ``rounds``."""

    from celery import Celery

    from benchmarks.observers import configure
    from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery, observe

    every_part = observe.PARTS

    def per_step() -> float:
        pikku = PikkuCelery(Celery(f"cpu-{uuid.uuid4().hex[:6]}", broker="memory://"),
                            store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                            worker_reaper=False)

        @pikku.step(name="cpu.noop")
        def noop(x: Any) -> Any:
            return x

        @pikku.workflow("cpu.sequence")
        def sequence(wf: Any, n: int) -> int:
            for i in range(n):
                wf.do(f"s{i}", noop, i)
            return n

        best = float("inf")
        for _ in range(rounds):
            started = time.process_time()
            pikku.start(sequence, steps, inline=True)
            best = min(best, (time.process_time() - started) / steps)
        return best

    found: dict[str, float] = {}
    try:
        observe.PARTS = _parts_without("tracing", "metrics")
        found["tracing, metrics off"] = per_step()
        observe.PARTS = _parts_without("tracing")
        found["metrics"] = per_step()
        observe.PARTS = every_part
        configure("on")
        found["tracing + metrics"] = per_step()
    finally:
        observe.PARTS = every_part
    base = found["tracing, metrics off"]
    lines = [f"pikku's own CPU per step, no driver ({steps} steps in place, inline, best of "
             f"{rounds}):"]
    lines += [f"  {name:<20} {value * 1e6:7.0f} us  ({(value - base) * 1e6:+5.0f} us)"
              for name, value in found.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=sorted(throughput.BROKERS), default="redis")
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--short", action="store_true", help="100 steps, one round (CI)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(measure(args.measure, args.tasks, args.steps))
        return
    tasks, rounds = (100, 1) if args.short else (args.tasks, args.rounds)
    with Stack() as stack:
        print(f"observability cost on {describe(stack.mongo_url)}\n")
        print(cpu(200 if args.short else 1000, 1 if args.short else 3))  # sets the SDK up
        print(commands(stack.redis_url, stack.mongo_url, 20))
        env: dict[str, Any] = {**os.environ, "BENCH_REDIS": stack.redis_url,
                               "BENCH_BROKER": throughput.BROKERS[args.broker]
                               or stack.redis_url}
        rates = interleaved(env, stack.mongo_url, rounds, tasks, args.steps)
    print()
    print(throughput.report(args.broker, tasks, args.steps, rates))
    print(ratios(rates))
    print(f"  load average at the end {throughput._load()}")


if __name__ == "__main__":
    main()
