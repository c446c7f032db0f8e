"""pikku side by side with DBOS Transact (issue 34): the latency of one 10-step run end to
end and the throughput of steps, measured interleaved in one run, on demand (not in CI).

    python -m benchmarks.peer_dbos [--rounds 3] [--runs 30] [--steps 10] [--tasks 300]
                                   [--dbos-poll 0.1] [--modes dbos,pikku-inproc,...]

DBOS Transact (``dbos==3.4.0`` from the package index) runs in a virtualenv of its own,
created on first use under ``~/.cache/pikku-bench/dbos-venv`` (``PIKKU_BENCH_DBOS_VENV``
moves it), on Debian's PostgreSQL 15 (``/usr/lib/postgresql/15/bin``) started for the
benchmark in a temporary directory on a free loopback port, as the ``postgres`` user when
run as root, ``fsync`` and ``synchronous_commit`` on (a commit waits for its WAL flush, as
pikku's majority writes wait for mongod's journal); it is stopped and its directory removed
afterwards, even on failure. Its side is ``benchmarks/_dbos_side.py``, run by that
virtualenv's Python, one fresh process and one fresh database per round.

pikku runs on the stack of the other benchmarks (``example_project.stack.Stack``: Redis,
a real ``mongod`` single-node replica set; ``benchmarks.target`` names it) and, on real
workers, on ``benchmarks.benchapp`` (two ``celery -A`` workers, threads pool 2 x 8, Redis
broker, fresh per measurement, as ``benchmarks.throughput``'s).

Latency of one run of ``--steps`` trivial steps, ``--runs`` runs one after another (p50 and
p95 of each round, after 3 unmeasured runs):

``dbos``          DBOS's workflow called in one process (the workflow runs in the caller's
                  thread, each step's output committed before the next runs);
``dbos-queue``    the same enqueued on a DBOS ``Queue`` polled every ``--dbos-poll`` s
                  (a third as many runs);
``pikku-inproc``  pikku in one process: ``start``, then the messages it publishes delivered
                  in the same process (``benchmarks.step_cost.Broker``), steps run in place;
``pikku``         ``pikku.start`` on the workers, steps run in place (the defaults), then
                  ``pikku.wait`` (woken by the run's end announced on Redis);
``pikku-poll``    the same, the run read every millisecond instead (``get_run``): how this
                  benchmark waited before ``wait`` listened for the run's end;
``pikku-sent``    the same with ``in_place_steps=0``: every step sent as a task;
``chain``         a Celery chain of ``--steps`` no-op tasks, results in Celery's MongoDB
                  result backend on the same ``mongod``, ``get(interval=0.001)``.

Throughput, steps per second of ``--tasks / --steps`` runs at once: ``dbos`` (in one
process, ``DBOS.start_workflow``), ``dbos-queue``, ``pikku`` and ``chain`` on the workers
(``benchmarks.throughput``'s measurement).

With ``dbos`` and ``pikku-inproc``, the CPU per step of the process that runs the workflow
(the servers' excluded) is printed too.

Steps do trivial work (DBOS's return their input + 1, benchapp's their input): what is
measured is each engine's overhead and its database's durable writes. Figures, never
asserts; the ratios pikku/DBOS and pikku/chain are computed within the run, round by round.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from benchmarks import throughput
from benchmarks.target import counting_store, describe
from example_project.stack import Stack, _die_with_parent, free_port

DBOS_VERSION = "3.4.0"
VENV = Path(os.environ.get("PIKKU_BENCH_DBOS_VENV",
                           Path.home() / ".cache" / "pikku-bench" / "dbos-venv"))
PG_BIN = Path("/usr/lib/postgresql/15/bin")
SIDE = Path(__file__).with_name("_dbos_side.py")
WARM_RUNS = 3
POLL_S = 0.001  # how often a chain's result.get polls its result backend (and pikku-poll)
LATENCY = ("dbos", "dbos-queue", "pikku-inproc", "pikku", "pikku-poll", "pikku-sent", "chain")
THROUGHPUT = ("tp-dbos", "tp-dbos-queue", "tp-pikku", "tp-chain")
CPU = ("cpu-dbos", "cpu-pikku-inproc")  # the latency runs' own process's CPU per step
MODES = ("dbos", "pikku-inproc", "pikku", "pikku-sent", "chain", "tp-pikku", "tp-chain")


# --- DBOS's virtualenv and PostgreSQL ---------------------------------------------------


def dbos_python() -> Path:
    """The DBOS virtualenv's Python, the virtualenv created (or repaired) when it lacks
    ``dbos==DBOS_VERSION``."""
    python = VENV / "bin" / "python"
    if _installed(python) != DBOS_VERSION:
        print(f"creating {VENV} with dbos=={DBOS_VERSION} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        f"dbos=={DBOS_VERSION}"], check=True)
    return python


def _installed(python: Path) -> str | None:
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", "from importlib.metadata import version; "
                          "print(version('dbos'))"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


class Postgres:
    """Debian's PostgreSQL 15 in a temporary directory on a free loopback port, as the
    ``postgres`` user when this process is root (``initdb`` refuses root), trust
    authentication on loopback; stopped and its directory removed on exit."""

    def __init__(self) -> None:
        self.workdir = ""
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.version = ""

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}"

    def _user(self) -> dict[str, Any]:
        return {"user": "postgres", "group": "postgres"} if os.geteuid() == 0 else {}

    def __enter__(self) -> Postgres:
        if not (PG_BIN / "postgres").exists():
            raise SystemExit(f"no PostgreSQL 15 in {PG_BIN}: apt-get install postgresql-15")
        self.workdir = tempfile.mkdtemp(prefix="pikku-bench-pg-")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.workdir, "postgres", "postgres")
        data = os.path.join(self.workdir, "data")
        subprocess.run([str(PG_BIN / "initdb"), "-D", data, "-U", "postgres", "--auth=trust",
                        "-E", "UTF8", "--no-sync", "--no-instructions"], cwd=self.workdir,
                       check=True, capture_output=True, **self._user())
        self.port = free_port()
        with open(os.path.join(self.workdir, "postgres.log"), "wb") as log:
            self.proc = subprocess.Popen(
                [str(PG_BIN / "postgres"), "-D", data, "-p", str(self.port),
                 "-c", "listen_addresses=127.0.0.1",
                 "-c", f"unix_socket_directories={self.workdir}",
                 "-c", "fsync=on", "-c", "synchronous_commit=on", "-c", "max_connections=200"],
                cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent(), **self._user())
        deadline = time.monotonic() + 30
        while subprocess.run([str(PG_BIN / "pg_isready"), "-q", "-h", "127.0.0.1", "-p",
                              str(self.port)]).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not start:\n{self._log_tail()}")
            time.sleep(0.1)
        self.version = subprocess.run([str(PG_BIN / "postgres"), "--version"],
                                      capture_output=True, text=True).stdout.strip()

    def _log_tail(self) -> str:
        try:
            text = Path(self.workdir, "postgres.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-20:])

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        """A fast shutdown (SIGINT), then SIGKILL after 20 s; the directory removed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = ""


def dbos_round(python: Path, postgres: Postgres, args: argparse.Namespace) -> dict[str, Any]:
    """One round of the DBOS side, in a fresh process on a fresh database."""
    url = f"{postgres.url}/dbos_bench_{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    out = subprocess.run(
        [str(python), str(SIDE), "--url", url, "--steps", str(args.steps), "--runs",
         str(args.runs), "--queue-runs", str(max(3, args.runs // 3)), "--workflows",
         str(args.tasks // args.steps), "--poll", str(args.dbos_poll)],
        env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"the DBOS side failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    found: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return found


# --- pikku's and Celery's side --------------------------------------------------------


def latency_on_workers(mode: str, runs: int, steps: int) -> list[float]:
    """Milliseconds of each of ``runs`` runs (or chains) one after another, on two fresh
    workers of ``benchmarks.benchapp`` configured by the environment (``mode_env``)."""
    from celery import chain

    benchapp = importlib.import_module("benchmarks.benchapp")
    env = dict(os.environ)
    logdir = Path(tempfile.mkdtemp(prefix="pikku-bench-"))
    procs = throughput.start_workers(env, 2, logdir)

    def one_chain() -> float:
        noop = benchapp.plain_noop
        started = time.perf_counter()
        result = chain(noop.s(0), *(noop.s() for _ in range(steps - 1))).apply_async()
        result.get(timeout=60, interval=POLL_S)
        return (time.perf_counter() - started) * 1000

    def one_run() -> float:
        pikku = benchapp.pikku
        started = time.perf_counter()
        run_id = pikku.start("bench.sequence", steps)
        if mode == "pikku-poll":  # how this benchmark waited before ``wait`` listened
            while not (run := pikku.get_run(run_id)).is_terminal:
                time.sleep(POLL_S)
        else:
            run = pikku.wait(run_id, 60)  # woken by the run's end, as result.get is
        elapsed = (time.perf_counter() - started) * 1000
        assert run.status == "completed", run.status
        return elapsed

    one = one_chain if mode == "chain" else one_run
    try:
        throughput.wait_ready(benchapp.pikku)
        for _ in range(WARM_RUNS):
            one()
        return [one() for _ in range(runs)]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(20)
        throughput.forget(env)
        shutil.rmtree(logdir, ignore_errors=True)


def latency_in_process(redis_url: str, mongo_url: str, runs: int, steps: int
                       ) -> tuple[list[float], float]:
    """Milliseconds of each of ``runs`` runs with pikku in one process, as DBOS's: ``start``,
    then every message it publishes delivered to the engine in this process, steps run in
    place, until none is left (the run has ended); and this process's CPU per step over
    them, in ms (pikku's, pymongo's, redis-py's: the servers are other processes)."""
    from celery import Celery

    from benchmarks.scaling import _sequential
    from pikku_celery import PikkuCelery, RedisLeaseService

    tag = uuid.uuid4().hex[:8]
    store = counting_store(mongo_url, f"pikku_peer_{tag}", [])
    prefix = f"pikku-peer-{tag}"
    leases = RedisLeaseService.from_url(redis_url, key_prefix=prefix)
    pikku = PikkuCelery(Celery("peer", broker="memory://"), store=store, leases=leases,
                        worker_reaper=False)
    broker = _sequential(pikku)
    definition = pikku.registry.steps["scale.noop"]

    def one() -> float:
        started = time.perf_counter()
        run_id = pikku.start("scale.sequential", steps)
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
        elapsed = (time.perf_counter() - started) * 1000
        assert pikku.get_run(run_id).status == "completed"
        return elapsed

    try:
        for _ in range(WARM_RUNS):
            one()
        cpu = time.process_time()
        found = [one() for _ in range(runs)]
        return found, (time.process_time() - cpu) * 1000 / (runs * steps)
    finally:
        import redis

        client = redis.Redis.from_url(redis_url)
        doomed = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if doomed:
            client.delete(*doomed)
        client.close()
        store.db.client.drop_database(store.db.name)
        store.db.client.close()


def _in_fresh_process(env: dict[str, str], mode: str, args: argparse.Namespace) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer_dbos", "--measure", mode, "--runs",
         str(args.runs), "--steps", str(args.steps)], env=env, capture_output=True,
        text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    values: list[float] = json.loads(out.stdout.strip().splitlines()[-1])
    return values


# --- rounds and the report --------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def one_round(r: int, modes: list[str], python: Path, postgres: Postgres, stack: Stack,
              env: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Every mode once, the order rotating from round to round. Returns latencies in ms
    (``mode: [..]``) and rates in steps/s (``tp-mode: float``)."""
    found: dict[str, Any] = {}
    load_before = _load()
    for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
        if mode == "dbos":
            side = dbos_round(python, postgres, args)
            found.update({"dbos": side["latency"], "dbos-queue": side["queue_latency"],
                          "tp-dbos": side["inproc"], "tp-dbos-queue": side["queue"],
                          "cpu-dbos": side["cpu_ms_per_step"], "dbos-version": side["version"]})
        elif mode == "pikku-inproc":
            found[mode], found["cpu-pikku-inproc"] = latency_in_process(
                stack.redis_url, stack.mongo_url, args.runs, args.steps)
        elif mode.startswith("tp-"):
            kind = mode[3:]
            found[mode] = throughput.run_mode(throughput.mode_env(env, kind, stack.mongo_url),
                                              kind, args.tasks, args.steps)
        else:
            found[mode] = _in_fresh_process(throughput.mode_env(env, mode, stack.mongo_url),
                                            mode, args)
    found["load"] = f"{load_before} -> {_load()}"
    return found


def print_round(r: int, found: dict[str, Any]) -> None:
    parts = [f"{mode} {percentile(found[mode], 0.5):.1f}/{percentile(found[mode], 0.95):.1f}"
             for mode in LATENCY if mode in found]
    rates = [f"{mode[3:]} {found[mode]:.0f}" for mode in THROUGHPUT if mode in found]
    cpu = [f"{mode[4:]} {found[mode]:.2f}" for mode in CPU if mode in found]
    print(f"round {r + 1} (load {found['load']}): latency p50/p95 ms: " + ", ".join(parts)
          + "; steps/s: " + ", ".join(rates) + "; CPU ms/step in one process: "
          + ", ".join(cpu), flush=True)


def report(rounds: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = [f"latency of one run of {args.steps} steps, {args.runs} runs per round, "
             f"{len(rounds)} rounds (median of the rounds' p50 and p95; the rounds' p50s):"]
    p50: dict[str, list[float]] = {}
    for mode in LATENCY:
        if mode not in rounds[0]:
            continue
        p50[mode] = [percentile(f[mode], 0.5) for f in rounds]
        p95 = [percentile(f[mode], 0.95) for f in rounds]
        lines.append(f"  {mode:<13} p50 {statistics.median(p50[mode]):7.1f} ms  p95 "
                     f"{statistics.median(p95):7.1f} ms  (p50s: "
                     + " ".join(f"{x:.1f}" for x in p50[mode]) + ")")

    def ratio(a: str, b: str, of: dict[str, list[float]], unit: str) -> None:
        if a in of and b in of:
            each = " ".join(f"x{x / y:.2f}" for x, y in zip(of[a], of[b], strict=True))
            median = statistics.median(of[a]) / statistics.median(of[b])
            lines.append(f"  {a.removeprefix('tp-')} / {b.removeprefix('tp-')}: x{median:.2f} "
                         f"of the medians; round by round {each}{unit}")

    for a, b in (("pikku", "dbos"), ("pikku", "chain"), ("pikku-inproc", "dbos"),
                 ("pikku-poll", "chain"), ("pikku", "pikku-poll"),
                 ("pikku-sent", "chain"), ("pikku-sent", "dbos")):
        ratio(a, b, p50, " (p50: below 1, pikku is faster)")
    if "pikku" in p50 and "chain" in p50 and "dbos" in p50:
        pikku = statistics.median(p50["pikku"])
        met = pikku <= statistics.median(p50["chain"]) and pikku <= statistics.median(p50["dbos"])
        lines.append(f"  goal (a {args.steps}-step run's p50 <= a chain's and <= DBOS's): "
                     f"{'met' if met else 'not met'}")
    cpu = {mode: [f[mode] for f in rounds] for mode in CPU if mode in rounds[0]}
    if cpu:
        lines.append("  CPU per step of the process running the workflow (in one process): "
                     + ", ".join(f"{mode[4:]} {statistics.median(v):.2f} ms"
                                 for mode, v in cpu.items()))
    rates = {mode: [f[mode] for f in rounds] for mode in THROUGHPUT if mode in rounds[0]}
    if rates:
        lines.append(f"throughput, {args.tasks // args.steps} runs of {args.steps} steps at once "
                     "(steps/s, median and range):")
        for mode, values in rates.items():
            lines.append(f"  {mode[3:]:<13} {statistics.median(values):7.1f} "
                         f"({min(values):.0f}-{max(values):.0f})")
        for a, b in (("tp-pikku", "tp-dbos"), ("tp-pikku", "tp-dbos-queue"),
                     ("tp-pikku", "tp-chain")):
            ratio(a, b, rates, " (steps/s: above 1, pikku does more)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=30, help="runs per latency mode and round")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=300,
                        help="steps per throughput measurement")
    parser.add_argument("--dbos-poll", type=float, default=0.1,
                        help="the DBOS queue's polling interval, s (DBOS's default: 1)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(latency_on_workers(args.measure, args.runs, args.steps)))
        return 0
    modes = args.modes.split(",")
    python = dbos_python() if "dbos" in modes else Path()
    with Stack() as stack, Postgres() as postgres:
        env: dict[str, Any] = {**os.environ, "BENCH_REDIS": stack.redis_url,
                               "BENCH_BROKER": stack.redis_url}
        print(f"pikku on {describe(stack.mongo_url)}")
        print(f"DBOS on {postgres.version} at 127.0.0.1:{postgres.port} (fsync on, "
              "synchronous_commit on)", flush=True)
        rounds = []
        for r in range(args.rounds):
            rounds.append(one_round(r, modes, python, postgres, stack, env, args))
            print_round(r, rounds[-1])
    if "dbos-version" in rounds[0]:
        print(f"DBOS Transact {rounds[0]['dbos-version']} (queue polled every "
              f"{args.dbos_poll:g} s); pikku and chains on 2 workers x 8 threads, Redis broker")
    print("\n".join(report(rounds, args)))
    print(f"  load average at the end {_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
