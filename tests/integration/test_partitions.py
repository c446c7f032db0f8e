"""Partitions and skewed clocks (issue 37): the fence proven where networks fail.

Real parts, each in a network namespace of its own on one bridge
(``tests/support/netrig.py``): a three-node ``mongod`` replica set (``m0``..``m2``), a
``redis-server`` for leases and another for the Celery broker (node ``redis``, ports 6379
and 6380), and two ``celery -A tests.integration.partitionapp`` workers (``w0``, ``w1``).
The test process talks to them through the bridge. Links are cut with ``iptables`` rules
inside the namespaces and healed by removing them. Fault 6 (``test_netem``) builds the same
rig again on the userspace delay switch (``links="switch"``: TAP devices instead of the
bridge), which holds every frame 200 ms and drops 5 % on each link.

Each test starts a few ``chain`` runs (``first`` -> ``left`` || ``right`` -> ``last``; the
bodies of one run in two, or of every run for the cuts of one worker, are *stubborn*: they
run on after their lease is lost and try to settle after the heal), waits until the chosen
worker has a body in flight, applies one fault, heals it, and checks, from the raw step
documents and the workers' file ledgers:

* every run completed with the output its input calls for;
* every step has exactly one succeeded attempt, the one its document holds; every earlier
  attempt is recorded failed (superseded); its result is that attempt's: a step is finished
  by its first attempt or reclaimed, never both recorded, and a settle refused after the
  heal changed nothing;
* every settle the store acknowledged is what it holds, none acknowledged twice, none lost;
* no attempt's body started twice;
* a body on a worker that lost its lease was told within one heartbeat of its lease's last
  confirmed deadline (fault 2/3/7).

It prints the time from the heal to the next settled step (``partition[...]: heal -> next
settled step 1.2 s``), also in the terminal summary and as the ``heal_to_settle_s`` JUnit
property. Only a generous liveness bound is asserted on time.

Long variants (the same cuts on the other worker, ``w1``: faults 2, 3 and 7) run with
``PIKKU_PARTITIONS_LONG=1``; they are not generated otherwise (never skipped). A rig that
cannot be built (not root, no iptables) fails the tests (``netrig.RigError``).
``PN_DEBUG=1`` prints the timeline of the cuts of one worker; ``PN_KEEP_LOGS=DIR`` keeps
every process's log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymongo.errors
import pytest
from celery import Celery

from pikku_celery import PikkuCelery
from pikku_celery.model import keys
from pikku_celery.store._docs import written_entries
from tests.integration import partitionapp as pa
from tests.support import netrig
from tests.support import summary as terminal_summary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
LONG = os.environ.get("PIKKU_PARTITIONS_LONG") == "1"
STEP_LEASE_S = 3.0
START_TRIES = 5  # a start that fails under loss is tried again with its run_id
HEARTBEAT_S = STEP_LEASE_S / 3  # heartbeat.py: one beat per third of the shortest lease
STEP_S = 2.0
RUNS = 3
STEPS = ("first", "left", "right", "last")
LIVENESS_S = 60.0
READY_TIMEOUT_S = 40.0
WORKERS = ("w0", "w1")


# --- the rig (one per module: ~4 s to build) ----------------------------------------------


@dataclass
class Workers:
    stack: netrig.Stack
    ledger_dir: Path
    env: dict[str, str]
    app: Celery
    pikku: PikkuCelery
    procs: dict[str, netrig.Proc] = field(default_factory=dict)
    skews: dict[str, str | None] = field(default_factory=dict)

    def start(self, role: str, skew: str | None = None) -> netrig.Proc:
        env = {**self.env, pa.ENV_WORKER: role, "PYTHONUNBUFFERED": "1"}
        # A skewed worker runs through the shim that gives it a working ``time.sleep``
        # under libfaketime (tests/support/faketime_shim.py).
        run = ["-m", "tests.support.faketime_shim"] if skew else ["-m"]
        proc = self.stack.rig.spawn(role, f"worker-{role}-{len(self.stack.rig.procs)}", [
            sys.executable, *run, "celery", "-A", "tests.integration.partitionapp", "worker",
            "-P", "threads", "-c", "4", "-Q", self.env[pa.ENV_QUEUE],
            "-n", f"{role}-{self.stack.rig.tag}@%h", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "--loglevel", "INFO"], env=env, cwd=ROOT, skew=skew)
        self.procs[role] = proc
        self.skews[role] = skew
        return proc

    def restart_all(self, skews: dict[str, str | None]) -> None:
        """Both workers stopped (together: each waits for its tasks) and started again
        with ``skews``."""
        procs = list(self.procs.values())
        for proc in procs:
            proc.signal(signal.SIGTERM)
        for proc in procs:
            proc.stop()
        for role in WORKERS:
            self.start(role, skews.get(role))
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all("ready." in p.log.read_text(errors="replace")
                      for p in self.procs.values()):
            for p in self.procs.values():
                if not p.alive():
                    pytest.fail(f"worker {p.name} exited:\n{p.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"workers not ready after {READY_TIMEOUT_S}s\n"
                            f"{self.diagnostics()}")
            time.sleep(0.1)

    def ledger(self, runs: Iterable[str] | None = None) -> list[dict[str, Any]]:
        entries = pa.read_ledger(self.ledger_dir)
        if runs is None:
            return entries
        wanted = set(runs)
        return [e for e in entries if e["run"] in wanted]

    def diagnostics(self, lines: int = 40) -> str:
        parts = [f"mongod states: {self.stack.states()}"]
        for role in self.stack.rig.nodes:
            rules = self.stack.rig.rules_in(role).strip().splitlines()
            extra = [r for r in rules if not r.startswith("-P")]
            if extra:
                parts.append(f"rules in {role}: {extra}")
        for p in self.procs.values():
            # The log's own lines (each warning, each exception's last line), not the frames
            # of the last traceback: what the worker went through, not only how it ended.
            told = [line for line in p.log_tail(5000).splitlines()
                    if line and not line[0].isspace() and not line.startswith("Traceback")]
            parts.append(f"--- {p.name} (pid {p.pid}, alive={p.alive()}):\n"
                         + "\n".join(told[-lines:]))
        return "\n".join(parts)


@contextlib.contextmanager
def rig_workers(workdir: Path, *, links: str | None = None, lease_s: float = STEP_LEASE_S,
                run_lease_s: float = 3.0, undispatched_s: float = 3.0,
                stalled_s: float = 4.0) -> Iterator[Workers]:
    """A rig (on the bridge, or on the userspace delay switch: ``links``, by default
    ``PIKKU_NETRIG_LINKS`` or the bridge), its stack, and the workers up and ready;
    everything stopped on exit."""
    t0 = time.monotonic()
    with netrig.NetRig(workdir / "rig", links=links) as rig:
        stack = netrig.Stack(rig).start()
        for role in WORKERS:
            stack.add_worker(role)
        ledger_dir = workdir / "ledger"
        ledger_dir.mkdir()
        tag = uuid.uuid4().hex[:8]
        env = {
            **os.environ,
            pa.ENV_BROKER: stack.broker_url,
            pa.ENV_REDIS: stack.redis_url,
            pa.ENV_MONGO: stack.mongo_url_for(f"pikku_pn_{tag}"),
            pa.ENV_PREFIX: f"pn-{tag}",
            pa.ENV_QUEUE: f"pikku-pn-{tag}",
            pa.ENV_LEDGER: str(ledger_dir),
            pa.ENV_STEP_LEASE: str(lease_s),
            pa.ENV_RUN_LEASE: str(run_lease_s),
            pa.ENV_REAPER: "0.5",
            pa.ENV_UNDISPATCHED: str(undispatched_s),
            pa.ENV_STALLED: str(stalled_s),
        }
        app = pa.build(env)
        w = Workers(stack, ledger_dir, env, app, app.pikku)
        for role in WORKERS:
            w.start(role)
        w.wait_ready()
        print(f"partition rig ({rig.links}) up in {time.monotonic() - t0:.1f} s (subnet "
              f"{netrig.SUBNET_BASE}.{rig.subnet}.0/24, tag {rig.tag})")
        try:
            yield w
        finally:
            if os.environ.get("PN_KEEP_LOGS"):  # a directory to copy the logs into
                rig.keep_logs(Path(os.environ["PN_KEEP_LOGS"]))
            with contextlib.suppress(Exception):
                app.close()
            with contextlib.suppress(Exception):
                w.pikku.engine.store.db.client.close()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    with rig_workers(tmp_path_factory.mktemp("netrig")) as w:
        yield w


@pytest.fixture
def workers(rig: Workers) -> Iterator[Workers]:
    """The module's rig, whole again after each test (rules removed, set whole, workers
    alive); a test that needs skewed workers restarts them so, and the next test that
    does not gets them unskewed."""
    if any(rig.skews.values()):
        rig.restart_all({})
    yield rig
    rig.stack.rig.heal_all()
    with contextlib.suppress(Exception):
        rig.stack.wait_whole(60)
    for role, proc in list(rig.procs.items()):
        if not proc.alive():
            rig.start(role, rig.skews.get(role))
            rig.wait_ready()


# --- runs and waits ------------------------------------------------------------------------


def wait_for(condition: Callable[[], Any], timeout: float, what: str,
             diagnostics: Callable[[], str], interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}\n{diagnostics()}")
        time.sleep(interval)


def start_runs(w: Workers, n: int = RUNS, seconds: float = STEP_S,
               first_seconds: float | None = None, stubborn: bool | None = None
               ) -> dict[str, int]:
    """``n`` runs of ``chain``; one in two has stubborn bodies (all, or none, with
    ``stubborn``)."""
    runs = {}
    for x in range(n):
        run_id = f"pn-{x}-{uuid.uuid4().hex[:8]}"
        data: dict[str, Any] = {"x": x, "seconds": seconds,
                                "stubborn": x % 2 == 1 if stubborn is None else stubborn}
        if first_seconds is not None:
            data["first_seconds"] = first_seconds
        for tries in range(1, START_TRIES + 1):
            # A start under loss can time out with its insert landed or not: the caller
            # starts again with the same run_id, which starts nothing twice.
            try:
                w.pikku.start("chain", data, run_id=run_id)
                break
            except pymongo.errors.PyMongoError as exc:
                if tries == START_TRIES:
                    raise
                print(f"start of {run_id} failed ({type(exc).__name__}: {exc}); again")
        runs[run_id] = x
    return runs


def in_flight_on(ledger: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    """Bodies started on ``role`` and not ended."""
    ended = {(e["invocation"], e["attempt"]) for e in ledger if e["event"] == "end"}
    return [e for e in ledger if e["event"] == "start" and e["w"] == role
            and (e["invocation"], e["attempt"]) not in ended]


def mid_body(w: Workers, runs: dict[str, int], role: str, min_left_s: float = 1.0,
             body_s: float = STEP_S, step: str | None = None
             ) -> Callable[[], list[dict[str, Any]]]:
    """A condition: ``role`` has a body in flight (of ``step``, if given) that has
    ``min_left_s`` still to run."""
    def check() -> list[dict[str, Any]]:
        now = time.monotonic()
        return [e for e in in_flight_on(w.ledger(runs), role)
                if now - e["m"] < body_s - min_left_s and step in (None, e["step"])]
    return check


def wait_runs(w: Workers, runs: dict[str, int]) -> None:
    deadline = time.monotonic() + LIVENESS_S
    for run_id in runs:
        try:
            w.pikku.wait(run_id, max(1.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            steps = [(s.step_name, s.status, s.attempt) for s in w.pikku.get_steps(run_id)]
            pytest.fail(f"{exc}\nsteps: {steps}\n{w.diagnostics()}")


def heal_to_settle(w: Workers, runs: dict[str, int], heal_m: float,
                   role: str | None = None) -> float | None:
    after = [e for e in w.ledger(runs) if e["event"] == "settled" and e["m"] > heal_m
             and (role is None or e["w"] == role)]
    return min(e["m"] for e in after) - heal_m if after else None


def report(name: str, w: Workers, runs: dict[str, int], fault_m: float, heal_m: float,
           record_property: Callable[[str, object], None], extra: str = "") -> float:
    took = wait_for(lambda: heal_to_settle(w, runs, heal_m), LIVENESS_S,
                    "a step to settle after the heal", w.diagnostics)
    ledger = w.ledger(runs)
    during = sum(1 for e in ledger if e["event"] == "settled" and fault_m < e["m"] <= heal_m)
    line = (f"partition[{name}]: heal -> next settled step {took:.2f} s "
            f"(fault held {heal_m - fault_m:.1f} s, {during} settles during it{extra})")
    print(line)
    terminal_summary.add(line)
    record_property("heal_to_settle_s", round(took, 2))
    return float(took)


# --- the invariants ------------------------------------------------------------------------


def check(w: Workers, runs: dict[str, int], name: str) -> dict[str, Any]:
    w.stack.wait_whole(60)
    ledger = w.ledger(runs)
    db = w.pikku.engine.store.db  # type: ignore[attr-defined]
    docs: dict[tuple[str, str], dict[str, Any]] = {
        (doc["run_id"], doc["step_name"]): doc
        for doc in db[keys.STEPS].find({"run_id": {"$in": list(runs)}}, {"data": 0})}
    problems = [*_runs(w, runs, docs), *_steps(docs), *_acknowledged(ledger, docs),
                *_ran_twice(ledger)]
    attempts = Counter(doc["attempt"] for doc in docs.values())
    stats = {
        "attempts": dict(sorted(attempts.items())),
        "superseded": sum(1 for e in ledger if e["event"] == "superseded"),
        "lost": sum(1 for e in ledger if e["event"] == "lost"),
    }
    summary = f"partition[{name}]: {len(runs)} runs, {len(docs)} steps, {stats}"
    print(summary)
    terminal_summary.add(summary)
    assert not problems, "\n".join([summary, *problems[:40], w.diagnostics()])
    assert len(docs) == len(STEPS) * len(runs)
    dead = [p.name for p in w.procs.values() if not p.alive()]
    assert not dead, f"workers exited: {dead}\n{w.diagnostics()}"
    return stats


def _runs(w: Workers, runs: dict[str, int], docs: dict[tuple[str, str], dict[str, Any]]
          ) -> Iterator[str]:
    for run_id, x in runs.items():
        run = w.pikku.get_run(run_id)
        if run.status != "completed" or run.output != pa.expected_output(x):
            yield f"run {run_id}: {run.status} {run.output!r} {run.error!r}"
        names = sorted(name for (r, name) in docs if r == run_id)
        if names != sorted(STEPS):
            yield f"run {run_id} has steps {names}"


def _steps(docs: dict[tuple[str, str], dict[str, Any]]) -> Iterator[str]:
    """Exactly one succeeded attempt per step, the one the document holds; every earlier
    attempt recorded failed; the result that attempt's."""
    for (run_id, name), doc in docs.items():
        entries = written_entries(doc)
        where = f"step {name!r} of run {run_id}"
        succeeded = [a for a, e in entries.items() if e["status"] == "succeeded"]
        if doc["status"] != "succeeded" or succeeded != [doc["attempt"]]:
            yield (f"{where}: {doc['status']} attempt {doc['attempt']}, succeeded entries "
                   f"{succeeded}")
        failed = sorted(a for a, e in entries.items() if e["status"] == "failed")
        if failed != list(range(1, doc["attempt"])):
            yield f"{where}: earlier attempts {failed}, attempt {doc['attempt']}"
        result = doc.get("result") or {}
        if (result.get("attempt"), result.get("invocation")) != (doc["attempt"], doc["_id"]):
            yield f"{where}: result {result} is not attempt {doc['attempt']}'s"


def _acknowledged(ledger: list[dict[str, Any]], docs: dict[tuple[str, str], dict[str, Any]]
                  ) -> Iterator[str]:
    """Every settle the store acknowledged is what it holds: a success is the step's
    outcome; a failure (an attempt that failed with attempts left: a retry follows) is that
    attempt's history entry. No step acknowledged succeeded twice, no attempt acknowledged
    twice."""
    settles = [e for e in ledger if e["event"] == "settled"]
    counted = Counter((e["run"], e["step"]) for e in settles if e["status"] == "succeeded")
    yield from (f"step {name!r} of run {run_id} acknowledged succeeded {n} times"
                for (run_id, name), n in counted.items() if n > 1)
    per_attempt = Counter((e["run"], e["step"], e["attempt"]) for e in settles)
    yield from (f"attempt {a} of {name!r} of run {run_id} acknowledged settled {n} times"
                for (run_id, name, a), n in per_attempt.items() if n > 1)
    for e in settles:
        doc = docs.get((e["run"], e["step"]))
        if doc is None:
            yield f"acknowledged settle of {e['step']!r} of run {e['run']} lost"
            continue
        entry = written_entries(doc).get(e["attempt"]) or {}
        held = ((doc["status"], doc["attempt"]) == (e["status"], e["attempt"])
                if e["status"] == "succeeded" else entry.get("status") == e["status"])
        if not held:
            yield (f"acknowledged settle {e['status']} attempt {e['attempt']} of "
                   f"{e['step']!r} of run {e['run']} (on {e['w']}) is not what the store "
                   f"holds: {doc['status']} attempt {doc['attempt']}, entry {entry}")
    for e in ledger:
        if e["event"] == "superseded":
            doc = docs.get((e["run"], e["step"]))
            if doc is not None and doc["attempt"] == e["attempt"]:
                yield (f"attempt {e['attempt']} of {e['step']!r} of run {e['run']} was told "
                       "superseded, yet the store holds it")


def _ran_twice(ledger: list[dict[str, Any]]) -> Iterator[str]:
    starts = Counter((e["invocation"], e["attempt"]) for e in ledger if e["event"] == "start")
    return (f"attempt {a} of {inv} started {n} times" for (inv, a), n in starts.items()
            if n > 1)


def told_in_time(ledger: list[dict[str, Any]], role: str, cut_m: float, heal_m: float
                 ) -> Iterator[str]:
    """A body on ``role`` still running one lease after the cut was told its lease was
    lost within one heartbeat of the lease's last confirmed deadline (no later than
    ``cut + lease + heartbeat``, a tick of slack)."""
    bound = STEP_LEASE_S + HEARTBEAT_S + 0.3
    ends = {(e["invocation"], e["attempt"]): e for e in ledger if e["event"] == "end"}
    losts = {(e["invocation"], e["attempt"]): e for e in ledger if e["event"] == "lost"}
    for e in ledger:
        if e["event"] != "start" or e["w"] != role or e["m"] > cut_m:
            continue
        key = (e["invocation"], e["attempt"])
        end = ends.get(key)
        if end is not None and end["m"] < cut_m + bound:
            continue  # ended before it had to be told
        if heal_m < cut_m + bound:
            continue  # the heal came first
        lost = losts.get(key)
        if lost is None:
            yield (f"attempt {e['attempt']} of {e['step']!r} of run {e['run']} on {role} ran "
                   f"{(end or {}).get('m', 0) - cut_m:.1f} s past the cut and was never told "
                   "its lease was lost")
        elif lost["m"] - cut_m > bound:
            yield (f"attempt {e['attempt']} of {e['step']!r} on {role} was told "
                   f"{lost['m'] - cut_m:.2f} s after the cut (bound {bound:.2f} s)")


# --- faults ----------------------------------------------------------------------------------


def cut_mongo(rig: netrig.NetRig, role: str) -> None:
    for m in netrig.Stack.MONGO_ROLES:
        rig.cut(role, m)


# The body the cut finds runs past its lease (``first``: 6.5 s against a 3 s lease) and is
# stubborn: told its lease is lost, it runs on and tries its settle after the heal. The cut
# lasts long enough for the lapsed step to be reclaimed elsewhere (lapse by 3 s, a reaper
# sweep every 0.5 s, a claim), and ends before the body does.
LONG_BODY_S = 6.5
FAULT_2_CUT_S = float(os.environ.get("PN_CUT_S", 5.0))


def timeline(w: Workers, runs: dict[str, int], zero_m: float) -> str:
    """The ledger of ``runs``, one line per entry, times relative to ``zero_m``."""
    return "\n".join(f"{e['m'] - zero_m:7.2f} {e['w']:6} {e['event']:10} {e['run'][:8]} "
                     f"{e['step']:6} a{e['attempt']} {e.get('status', '')}"
                     for e in w.ledger(runs))


def _isolated_worker(w: Workers, name: str, role: str, apply: Callable[[], None],
                     cut_s: float, record_property: Callable[[str, object], None]) -> None:
    runs = start_runs(w, seconds=1.0, first_seconds=LONG_BODY_S, stubborn=True)
    wait_for(mid_body(w, runs, role, min_left_s=LONG_BODY_S - 0.5, body_s=LONG_BODY_S,
                      step="first"), 30, f"a body in flight on {role}", w.diagnostics,
             interval=0.02)
    cut_m = time.monotonic()
    apply()
    time.sleep(cut_s)
    heal_m = time.monotonic()
    w.stack.rig.heal_all()
    took_role = None

    report(name, w, runs, cut_m, heal_m, record_property)
    wait_runs(w, runs)
    took_role = heal_to_settle(w, runs, heal_m, role)
    if took_role is not None:
        line = f"partition[{name}]: heal -> next settled step on {role} {took_role:.2f} s"
        print(line)
        terminal_summary.add(line)
    if os.environ.get("PN_DEBUG"):  # the timeline, relative to the cut
        print(timeline(w, runs, cut_m))
    check(w, runs, name)
    problems = list(told_in_time(w.ledger(runs), role, cut_m, heal_m))
    assert not problems, "\n".join([*problems, w.diagnostics()])


# 2. A worker cut off from Redis (its leases; the broker on the other port stays) while its
# step body runs: its heartbeat can renew MongoDB but not Redis.
@pytest.mark.parametrize("role", ["w0", *(["w1"] if LONG else [])])
def test_worker_cut_from_redis(workers: Workers, role: str,
                               record_property: Callable[[str, object], None]) -> None:
    _isolated_worker(workers, f"isolate_worker_redis:{role}", role,
                     lambda: workers.stack.rig.cut(role, "redis", port=netrig.REDIS_PORT),
                     FAULT_2_CUT_S, record_property)


# 3. A worker cut off from every MongoDB node while its step body runs: its heartbeat can
# renew Redis but not MongoDB.
@pytest.mark.parametrize("role", ["w0", *(["w1"] if LONG else [])])
def test_worker_cut_from_mongo(workers: Workers, role: str,
                               record_property: Callable[[str, object], None]) -> None:
    _isolated_worker(workers, f"isolate_worker_mongo:{role}", role,
                     lambda: cut_mongo(workers.stack.rig, role), FAULT_2_CUT_S,
                     record_property)


# 1. The primary cut off from both secondaries, still reachable by one worker (``w0``, cut
# off from the secondaries: it sees only the minority primary) while the other (``w1``) sees
# only the majority. Writes the minority primary accepts are never majority-acknowledged:
# none may be acknowledged as settled; the majority elects and the runs complete.
PARTITION_S = 8.0  # the 2 s election timeout, an election, and settles on the new primary


def test_minority_primary(workers: Workers,
                          record_property: Callable[[str, object], None]) -> None:
    w = workers
    rig = w.stack.rig
    old = w.stack.primary()
    assert old is not None, w.diagnostics()
    secondaries = [m for m in netrig.Stack.MONGO_ROLES if m != old]
    runs = start_runs(w, seconds=1.5)
    wait_for(mid_body(w, runs, "w0", min_left_s=0.5, body_s=1.5), 30,
             "a body in flight on w0", w.diagnostics, interval=0.02)
    cut_m = time.monotonic()
    for s in secondaries:
        rig.cut(old, s)
        rig.cut("w0", s)
    rig.cut("w1", old)
    new = wait_for(lambda: next((m for m in secondaries
                                 if w.stack.states().get(m) == "PRIMARY"), None),
                   30, "the majority to elect", w.diagnostics, interval=0.1)
    elected_s = time.monotonic() - cut_m
    time.sleep(max(0.0, PARTITION_S - (time.monotonic() - cut_m)))
    heal_m = time.monotonic()
    rig.heal_all()
    report("partition_primary", w, runs, cut_m, heal_m, record_property,
           extra=f"; {new} elected {elected_s:.1f} s after the cut")
    wait_runs(w, runs)
    check(w, runs, "partition_primary")


# 5. Redis (leases and broker) cut off from every worker for longer than the step lease,
# then healed.
REDIS_CUT_S = STEP_LEASE_S + 3.0


def test_redis_cut_from_everyone(workers: Workers,
                                 record_property: Callable[[str, object], None]) -> None:
    w = workers
    rig = w.stack.rig
    runs = start_runs(w, seconds=1.0, first_seconds=LONG_BODY_S)
    wait_for(mid_body(w, runs, "w0", min_left_s=LONG_BODY_S - 0.5, body_s=LONG_BODY_S,
                      step="first"), 30, "a body in flight on w0", w.diagnostics,
             interval=0.02)
    cut_m = time.monotonic()
    for role in WORKERS:
        rig.cut("redis", role)
    time.sleep(REDIS_CUT_S)
    heal_m = time.monotonic()
    rig.heal_all()
    report("isolate_redis", w, runs, cut_m, heal_m, record_property)
    wait_runs(w, runs)
    check(w, runs, "isolate_redis")


# 4. Replies lost, requests delivered: the primary's packets to ``w0`` are dropped (its
# requests land) while ``w0`` settles a step and claims the next, twice: outcomes whose
# reply was lost are recognised, never doubled.
REPLIES_LOST_S = (2.0, 4.5)  # shorter than the step lease, then longer


def test_replies_lost(workers: Workers, record_property: Callable[[str, object], None]
                      ) -> None:
    w = workers
    rig = w.stack.rig
    runs: dict[str, int] = {}
    took = []
    for hold_s in REPLIES_LOST_S:
        primary = w.stack.primary()
        assert primary is not None, w.diagnostics()
        # Fresh runs for each drop: the last drop's runs may have ended on w1 meanwhile.
        fresh = start_runs(w, n=4, seconds=1.0)
        runs.update(fresh)
        # Just before a body on w0 ends: its settle, and the claim of the next step
        # that travels with it, meet the drop.
        wait_for(lambda: [e for e in in_flight_on(w.ledger(runs), "w0")
                          if time.monotonic() - e["m"] > 0.8], 40,
                 "a body on w0 about to end", w.diagnostics, interval=0.01)
        cut_m = time.monotonic()
        rig.drop_replies("w0", primary, port=netrig.MONGO_PORT)
        time.sleep(hold_s)
        heal_m = time.monotonic()
        rig.heal_all()
        took.append(report(f"drop_replies:{hold_s:.1f}s", w, runs, cut_m, heal_m,
                           record_property))
    wait_runs(w, runs)
    check(w, runs, "drop_replies")


# 6. ``netem``: 200 ms delay (one way) and 5 % loss on every link for a whole (short)
# profile. The kernels here have no ``sch_netem``, so this test builds its own rig on the
# userspace delay switch (``netrig.NetRig(links="switch")``, tests/support/delay_switch.py:
# the same nodes, names and addresses, on TAP devices instead of a bridge), starts the
# workers undelayed, then delays every frame 200 ms and drops 5 % of them on each link a
# frame crosses (the test process's own link delayed, not lossy). The delay is measured,
# not assumed: Redis ``PING`` and mongod ``ping`` round trips from the test process,
# before (well under 100 ms), during (at least 400 ms) and after (well under again).
#
# Leases three times the other tests' (step and run lease 9 s, so a store call's deadline,
# a third of the lease, is 3 s): a majority write is at least four one-way trips (client ->
# primary -> the secondaries' oplog fetch -> their progress report -> the client), 800 ms
# under this delay and more with a retransmission; with the 3 s lease (1 s deadline) the
# renewals missed their deadline again and again and a step was at attempt 4 after 60 s.
NETEM_DELAY_MS = 200.0
LOSS = 0.05
NETEM_RUNS = 4
NETEM_LEASE_S = 9.0
UNDELAYED_RTT_S = 0.1  # "well under" the 400 ms of the delay


@pytest.fixture
def switch_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """The module's rig built again on the delay switch, with longer leases, for this test
    alone."""
    with rig_workers(tmp_path_factory.mktemp("netrig-switch"), links="switch",
                     lease_s=NETEM_LEASE_S, run_lease_s=NETEM_LEASE_S,
                     undispatched_s=NETEM_LEASE_S, stalled_s=NETEM_LEASE_S * 4 / 3) as w:
        yield w


def _round_trips(w: Workers) -> dict[str, list[float]]:
    """Round trips (s) from the test process on established connections: Redis ``PING``
    and ``m0``'s ``ping`` command, five each."""
    out = {"redis": netrig.redis_rtt(w.stack.rig.node("redis").ip)}
    with w.stack.direct("m0", 10_000) as client:
        client.admin.command("ping")
        took = []
        for _ in range(5):
            t0 = time.monotonic()
            client.admin.command("ping")
            took.append(time.monotonic() - t0)
    out["mongod"] = took
    return out


def _ms(rtts: dict[str, list[float]]) -> str:
    return ", ".join(f"{k} {min(v) * 1000:.1f}-{max(v) * 1000:.1f} ms"
                     for k, v in rtts.items())


def test_netem(switch_workers: Workers, record_property: Callable[[str, object], None]
               ) -> None:
    w = switch_workers
    rig = w.stack.rig
    assert rig.can_delay and netrig.delay_available() in ("netem", "switch")
    before = _round_trips(w)
    t0 = time.monotonic()
    baseline = start_runs(w, n=NETEM_RUNS, seconds=0.5)
    wait_runs(w, baseline)
    baseline_s = time.monotonic() - t0

    fault_m = time.monotonic()
    rig.impair(delay_ms=NETEM_DELAY_MS, loss=LOSS)
    during = _round_trips(w)
    runs = start_runs(w, n=NETEM_RUNS, seconds=0.5)
    wait_runs(w, runs)
    done_s = time.monotonic() - fault_m
    lost = sum(p["lost"] for p in rig.link_stats()["ports"].values())
    heal_m = time.monotonic()
    rig.heal_all()  # the switch's delay and loss back to none
    after = _round_trips(w)
    more = start_runs(w, n=1, seconds=0.5)
    line = (f"partition[netem]: round trips from the test process: undelayed {_ms(before)}; "
            f"under {NETEM_DELAY_MS:.0f} ms each way {_ms(during)}; healed {_ms(after)}")
    print(line)
    terminal_summary.add(line)
    record_property("netem_rtt_ms", round(min(during["redis"]) * 1000, 1))
    floor = 2 * NETEM_DELAY_MS / 1000
    assert all(min(v) >= floor for v in during.values()), (
        f"the delay is not real: {_ms(during)} (expected >= {floor * 1000:.0f} ms)")
    assert all(max(v) < UNDELAYED_RTT_S for v in (*before.values(), *after.values())), (
        f"undelayed round trips not well under the delay: {_ms(before)}; {_ms(after)}")
    took = report("netem", w, more, fault_m, heal_m, record_property,
                  extra=f"; {NETEM_RUNS} runs done under {NETEM_DELAY_MS:.0f} ms delay and "
                        f"{LOSS:.0%} loss per link in {done_s:.1f} s, {baseline_s:.1f} s "
                        f"undelayed; {lost} frames dropped by the switch")
    assert took is not None
    wait_runs(w, more)
    check(w, {**baseline, **runs, **more}, "netem")


# 7. Skewed clocks (``w0`` 30 s ahead, ``w1`` 30 s behind, the whole process under
# libfaketime) combined with fault 2: leases are judged on the servers' clocks, so the skew
# changes nothing observable. Last in the module: it restarts the workers skewed (the
# ``workers`` fixture unskews them for any test after it).
SKEWS: dict[str, str | None] = {"w0": "+30s", "w1": "-30s"}
@pytest.mark.parametrize("role", ["w0", *(["w1"] if LONG else [])])
def test_skewed_clocks_with_redis_cut(workers: Workers, role: str,
                                      record_property: Callable[[str, object], None]) -> None:
    w = workers
    netrig.check_prerequisites(skew=True)
    w.restart_all(SKEWS)
    _isolated_worker(w, f"skew_clock+isolate_worker_redis:{role}", role,
                     lambda: w.stack.rig.cut(role, "redis", port=netrig.REDIS_PORT),
                     FAULT_2_CUT_S, record_property)
    # Each worker's wall clock against the test's, from its ledger: ``t`` (its wall
    # clock) against ``m`` (the system-wide monotonic clock, left unskewed).
    now_t, now_m = time.time(), time.monotonic()
    seen = {e["w"]: e["t"] - (now_t - (now_m - e["m"]))
            for e in w.ledger()[-60:] if e["w"] in WORKERS}
    line = "partition[skew_clock]: worker clocks vs. the test's: " + ", ".join(
        f"{r} {seen.get(r, float('nan')):+.0f} s" for r in WORKERS)
    print(line)
    terminal_summary.add(line)
    assert seen.get("w0", 0) > 25 and seen.get("w1", 0) < -25, (
        f"the workers' clocks are not skewed as asked: {seen}")
