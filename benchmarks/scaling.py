"""How the cost of a step grows with the length of its run: one run of N sequential no-op
steps for N = 10, 100, 1,000 (and 10,000 with ``--huge``), time per step and MongoDB
documents and bytes returned per step.

One process plays worker and orchestrator (as ``benchmarks.step_cost`` does): a queue stands
in for the broker and delivers every message to the engine call its Celery task would make,
so the figures are the engine's, MongoDB's and Redis's, without a broker's or a pool's. By
default steps run in place (a delivered message's pass runs the steps it records, up to
``in_place_steps`` in a row, replaying the run once per streak); ``--each-sent`` sends every
step (``in_place_steps=0``: each step's worker replays the run after it), ``--messages``
also sends a message per settle. CPU per step is this process's (``time.process_time``: the
engine, pymongo's and redis-py's client work), the servers' excluded. The
store is the one users get (majority writes and reads) on the MongoDB of
``benchmarks.target`` (a real ``mongod`` single-node replica set unless ``PIKKU_MONGO_URL``).

The sizes are measured interleaved (``--rounds`` rounds, each running every size once) and
reported as medians; the ratio of a size's time per step to the smallest's is the figure
that says whether a pass costs O(1) or O(N). Replay itself is O(N) per pass (the workflow
runs from the top), so a run of N steps does N²/2 cheap dictionary lookups in all; what must
not grow is what each pass reads.

    python -m benchmarks.scaling [--sizes 10,100,1000] [--huge] [--rounds 3]
                                 [--each-sent | --messages]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from typing import Any

from celery import Celery

from benchmarks.step_cost import Broker  # delivers what the engine publishes, in order
from benchmarks.target import counting_store, describe
from example_project.stack import Stack
from pikku_celery import PikkuCelery, RedisLeaseService
from tests.support.counting import CountingRedis, MongoCommands


def _sequential(pikku: PikkuCelery) -> Broker:
    """Register the benchmark's no-op step and sequential workflow; deliver through a
    ``Broker``."""
    broker = Broker()
    pikku.engine.dispatcher = broker

    @pikku.step(name="scale.noop")
    def noop(data: Any) -> Any:
        return data

    @pikku.workflow("scale.sequential")
    def sequential(wf: Any, n: int) -> int:
        for i in range(n):
            wf.do(f"s{i}", noop, i)
        return n

    return broker


def one_run(steps: int, redis_url: str, mongo_url: str, *, in_place: bool,
            in_place_steps: int = 100) -> dict[str, float]:
    mongo = MongoCommands()
    store = counting_store(mongo_url, f"pikku_scale_{uuid.uuid4().hex[:8]}", [mongo])
    client = store.db.client
    redis_client = CountingRedis.from_url(redis_url)
    prefix = f"pikku-scale-{uuid.uuid4().hex[:8]}"
    pikku = PikkuCelery(Celery("scale", broker="memory://"), store=store,
                        leases=RedisLeaseService(redis_client, key_prefix=prefix),
                        continue_in_place=in_place, in_place_steps=in_place_steps,
                        worker_reaper=False)
    broker = _sequential(pikku)

    try:
        definition = pikku.registry.steps["scale.noop"]
        run_id = pikku.start("scale.sequential", steps)
        mongo.clear()
        started, cpu = time.perf_counter(), time.process_time()
        while broker.queue:
            kind, target, step_name, expected = broker.queue.popleft()
            broker.delivering = True
            if kind == "step":
                assert step_name is not None
                pikku.engine.execute_step(definition, target, step_name,
                                              expected=expected)
            else:
                pikku.engine.advance(target, step_name=step_name)
            broker.delivering = False
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
        assert pikku.get_run(run_id).status == "completed"
        return {"ms_per_step": elapsed * 1000 / steps, "cpu_ms": cpu * 1000 / steps,
                "documents": sum(mongo.documents.values()) / steps,
                "kb": sum(mongo.reply_bytes.values()) / steps / 1024}
    finally:
        doomed = list(redis_client.scan_iter(match=f"{prefix}:*"))
        if doomed:
            redis_client.delete(*doomed)
        client.drop_database(store.db.name)
        client.close()


def engine_cpu(steps: int) -> float:
    """pikku's own CPU per step, in ms, with no driver in the way: the same run on the
    in-memory store and lease service (what remains is the engine, the claim layer, the
    replay and the in-memory store's copies), timed with ``time.process_time``."""
    from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore

    pikku = PikkuCelery(Celery("scale-cpu", broker="memory://"),
                        store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    broker = _sequential(pikku)

    run_id = pikku.start("scale.sequential", steps)
    cpu = time.process_time()
    while broker.queue:
        kind, target, step_name, expected = broker.queue.popleft()
        broker.delivering = True
        if kind == "step":
            assert step_name is not None
            pikku.engine.execute_step(pikku.registry.steps["scale.noop"], target, step_name,
                                      expected=expected)
        else:
            pikku.engine.advance(target, step_name=step_name)
        broker.delivering = False
    cpu = time.process_time() - cpu
    assert pikku.get_run(run_id).status == "completed"
    return cpu * 1000 / steps


_PACKAGES = (("pikku_celery", "pikku_celery"), ("pymongo", "pymongo/bson"),
             ("bson", "pymongo/bson"), ("redis", "redis"))


def profiled(steps: int, redis_url: str, mongo_url: str) -> str:
    """CPU per step by package: each function's own time (``tottime``) under cProfile,
    summed by the package its file is in. Profiling slows Python down, so the split is
    the figure, and the total is an upper bound."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    one_run(steps, redis_url, mongo_url, in_place=True)
    profile.disable()
    by: dict[str, float] = {}
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    for (filename, _, _), (_, _, tottime, _, _) in stats.items():
        package = next((label for name, label in _PACKAGES if f"/{name}/" in filename),
                       "the rest (stdlib, sockets, waits)")
        by[package] = by.get(package, 0.0) + tottime
    total = sum(by.values())
    lines = [f"profile of one run of {steps} steps run in place, CPU per step by package:"]
    for package, seconds in sorted(by.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {package:<34} {seconds * 1000 / steps:6.3f} ms "
                     f"({seconds / total:4.0%})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--huge", action="store_true", help="also N = 10,000 (minutes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="one run of the largest size under cProfile: CPU per step by "
                             "package (pikku_celery, pymongo/bson, redis, the rest)")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--each-sent", action="store_true",
                       help="in_place_steps=0: every step sent, the run passed after each")
    modes.add_argument("--messages", action="store_true",
                       help="continue_in_place=False: a message per settle")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")] + ([10_000] if args.huge else [])
    if args.profile:
        with Stack() as stack:
            print(profiled(sizes[-1], stack.redis_url, stack.mongo_url))
        cpu = statistics.median(engine_cpu(sizes[-1]) for _ in range(args.rounds))
        print(f"pikku's own CPU, no driver (in-memory store and leases, {sizes[-1]} steps, "
              f"median of {args.rounds}): {cpu:.3f} ms per step")
        return
    found: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    with Stack() as stack:
        mongo = describe(stack.mongo_url)
        for r in range(args.rounds):
            for n in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
                found[n].append(one_run(n, stack.redis_url, stack.mongo_url,
                                        in_place=not args.messages,
                                        in_place_steps=0 if args.each_sent else 100))
    mode = ("messages" if args.messages else "each step sent" if args.each_sent
            else "steps run in place")
    print(f"scaling: one run of N sequential steps ({mode}), {args.rounds} rounds, medians, "
          f"on {mongo}")
    base = statistics.median(f["ms_per_step"] for f in found[sizes[0]])
    for n in sizes:
        ms = statistics.median(f["ms_per_step"] for f in found[n])
        docs = statistics.median(f["documents"] for f in found[n])
        kb = statistics.median(f["kb"] for f in found[n])
        cpu = statistics.median(f["cpu_ms"] for f in found[n])
        print(f"  N={n:<6} {ms:6.2f} ms/step (x{ms / base:4.2f} of N={sizes[0]}), "
              f"CPU {cpu:5.2f} ms/step, {docs:5.2f} documents/step, {kb:6.2f} KB/step")


if __name__ == "__main__":
    main()
