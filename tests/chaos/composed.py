"""Retry, fork and approve in the chaos mix (issue 31): what the driver did beyond starts,
sends and cancels (``Operations``, filled by ``tests.chaos.ops``), and the invariants of
contract section 7 the checker holds those operations to.

The operations compose with everything else in the mix: failed and cancelled runs (orders,
events runs cancelled while they wait, approval runs cancelled while they wait, limited
runs cancelled while queued or running) are retried during the faults, completed runs are
forked from a step drawn from the seed (with and without ``keep_decisions``), some forks
are repeated, and some name an existing run as their new id (a probe: it must be refused).

What must hold (each planted as a defect in ``tests/chaos/test_checker.py``):

* nothing after an end a retry undid: between a run's end and its retry, no attempt was
  claimed and ran its body, and no body recorded an outcome past the documented window;
  after a retry no step is fenced by a cancel that came before it (issue 31, defect 4);
* a reopened wait waits: an event wait without a timeout never times out, one with a
  timeout never before its own expiry; an approval's decision is one the driver gave, and
  it was recorded after the driver gave it;
* limits hold: at every sampled moment (a snapshot read of the store during the faults),
  no key has more live runs than its limit and every live run holds a slot of its group;
* a fork creates a new run (its repeat returns it; an id naming another run is a conflict
  and that run is unchanged), names its source, copies only its source's succeeded steps
  recorded before the fork's step (gates and taken events only with ``keep_decisions``),
  each with the source's result; the source's steps and events are unchanged by the fork;
  no step copied by a fork is found in a run that is not a fork.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pikku_celery.model import keys
from pikku_celery.store._slots import holder_run

Doc = dict[str, Any]
APPROVAL_GATE = "__approval:go"  # the chaos app's approval gate (``chaos.approver``)
GATE_PREFIXES = ("__approval:", "__event:")  # decided gates and taken events
CANCELLED_ERROR = "WorkflowCancelledError"
LIVE = ("running", "suspended")
SLACK_MS = 1_500  # clocks of the driver and the store's writers (a skewed one is put back)


@dataclass
class Operations:
    """What the driver did: every call and what it returned, on the driver's wall clock
    (epoch ms, ``before``/``after`` the call)."""

    # run -> [{"before", "after", "done": retry()'s answer, "status": before the retry,
    #          "end_ms": the run's updated_ms before the retry}]
    retries: dict[str, list[Doc]] = field(default_factory=dict)
    # fork run id -> {"source", "from_step", "keep", "returned", "repeat" (the id a repeat
    #  returned, when repeated), "source_steps": {name: fingerprint}, "source_order":
    #  [names, in the order recorded], "source_events": [...]}
    forks: dict[str, Doc] = field(default_factory=dict)
    # forks that named another run's id: {"source", "from_step", "target", "outcome",
    #  "target_steps": {name: fingerprint}}; outcome "conflict" is the only right one
    probes: list[Doc] = field(default_factory=list)
    # run -> [{"decision", "before", "after", "outcome": "recorded" | why not}]
    approvals: dict[str, list[Doc]] = field(default_factory=dict)
    samples: int = 0  # snapshot reads of the limited runs and their slots
    samples_failed: int = 0  # a fault made the read fail
    breaches: list[str] = field(default_factory=list)  # what the samples found
    errors: list[str] = field(default_factory=list)  # calls that raised what they must not

    def done_retries(self, run_id: str) -> list[Doc]:
        return [r for r in self.retries.get(run_id, []) if r["done"]]


def fingerprint(doc: Doc) -> Doc:
    """What of a step a fork must never change (its source's, or another run's)."""
    return {"status": doc.get("status"), "attempt": doc.get("attempt"),
            "result": doc.get("result"), "updated_ms": doc.get("updated_ms"),
            "_id": doc.get("_id"), "run_id": doc.get("run_id")}


def step_fingerprints(db: Any, run_id: str) -> dict[str, Doc]:
    return {d["step_name"]: fingerprint(d)
            for d in db[keys.STEPS].find({"run_id": run_id}, {"data": 0})}


def event_fingerprints(db: Any, run_id: str) -> list[Doc]:
    return sorted(({"seq": d.get("seq"), "name": d.get("name"), "payload": d.get("payload"),
                    "key": d.get("key")} for d in db[keys.EVENTS].find({"run_id": run_id})),
                  key=lambda e: e["seq"] or 0)


def revived(run_id: str, cancels: dict[str, tuple[int, int]], ops: Operations | None) -> bool:
    """Was the run retried (and run again) after its last cancel? It must then end as its
    spec says, not cancelled."""
    done = ops.done_retries(run_id) if ops is not None else []
    return bool(done) and (run_id not in cancels or cancels[run_id][0] < done[-1]["before"])


def limit_breaches(live: Iterable[Doc], slots: Iterable[Doc], limit: int, at: str) -> list[str]:
    """Contract 7.4 at one moment: ``live`` (the running or suspended runs of a limited
    workflow, with ``slot`` and ``lineage``) and ``slots`` (their groups, with ``holders``)
    read in one snapshot. No group has more live runs than ``limit``; every live run holds
    a slot of its group in its current life (a holder is a run in one life of it, its
    retries so far: ``store._slots.slot_holder``; a slot of a life that ended is not the
    run's)."""
    holders = {d["_id"]: {holder_run(h) for h in d.get("holders") or []} for d in slots}
    by_group: dict[str, list[str]] = {}
    found = []
    for run in live:
        group = run.get("slot") or "?"
        by_group.setdefault(group, []).append(run["_id"])
        life = sum(1 for e in run.get("lineage") or [] if e.get("op") == "retry")
        if (run["_id"], life) not in holders.get(group, set()):
            shown = sorted(f"{r} #{n}" if n else r for r, n in holders.get(group, set()))
            found.append(f"{at}: run {run['_id']} is {run.get('status')} in life {life} "
                         f"holding no slot of its group {group} (holders {shown})")
    for group, runs in by_group.items():
        if len(runs) > limit:
            found.append(f"{at}: group {group} has {len(runs)} live runs {sorted(runs)}, "
                         f"limit {limit}")
    return found


def check_operations(db: Any, specs: dict[str, dict[str, Any]], ops: Operations,
                     cancels: dict[str, tuple[int, int]], ev: Any, report: Any) -> None:
    """Every invariant of the module docstring; counts in ``report.operations``."""
    counts: Counter[str] = report.operations
    runs = {d["_id"]: d for d in db[keys.RUNS].find(
        {"_id": {"$in": list(set(ops.retries) | set(ops.forks) | set(ops.approvals))}},
        {"input": 0, "state": 0})}
    for run_id, calls in ops.retries.items():
        kind = specs.get(run_id, {}).get("kind", "order")
        _check_retried(run_id, kind, calls, runs.get(run_id) or {}, cancels, ev, report)
    _check_event_waits(db, specs, report)
    for run_id, spec in specs.items():
        if spec.get("kind") == "approver":
            _check_approval(run_id, spec, runs.get(run_id) or {}, ops, ev, report)
    for fork_id, fork in ops.forks.items():
        _check_fork(db, fork_id, fork, runs.get(fork_id) or {}, report)
    for probe in ops.probes:
        _check_probe(db, probe, report)
    _check_no_foreign_copies(db, ops, report)
    counts["limit samples"] = ops.samples
    counts["limit samples a fault made fail"] = ops.samples_failed
    for breach in ops.breaches:
        report.violations.append(f"limit breached: {breach}")
    for error in ops.errors:
        report.violations.append(f"operation: {error}")


# --- retries ---------------------------------------------------------------------------------


def _check_retried(run_id: str, kind: str, calls: list[Doc], run: Doc,
                   cancels: dict[str, tuple[int, int]], ev: Any, report: Any) -> None:
    from tests.chaos.checker import ENDED_WINDOW_MS, _own_outcome, _slack_ms

    counts: Counter[str] = report.operations
    counts["retries"] += len(calls)
    counts["retries refused (group full or not ended)"] += sum(not c["done"] for c in calls)
    done = [c for c in calls if c["done"]]
    if not done:
        return
    where = f"retried {kind} run {run_id}"
    counts["runs retried"] += 1
    counts[f"{kind} runs retried after {done[0]['status']}, then {run.get('status')}"] += 1
    for call in done:  # between the end it undid and the retry, nothing ran
        end, retry = call.get("end_ms"), call["before"]
        if end is None:
            continue
        for doc in ev.steps.get(run_id, []):
            for attempt, entry in ev.history.get(doc["_id"], {}).items():
                started = ev.shared_ms(entry.get("started_ms"), entry.get("worker"))
                settled = ev.shared_ms(entry.get("ended_ms"), entry.get("worker"))
                ran = any(e["event"] == "start" and e["attempt"] == attempt
                          for e in ev.bodies.get(doc["_id"], []))
                if (ran and started is not None
                        and end + _slack_ms(ev, end, started) < started < retry - SLACK_MS):
                    report.violations.append(
                        f"{where}: step {doc['step_name']!r} attempt {attempt} was claimed "
                        f"{started - end} ms after the run ended, before its retry")
                elif (settled is not None and _own_outcome(entry) and settled < retry - SLACK_MS
                      and settled > end + ENDED_WINDOW_MS + _slack_ms(ev, end, settled)):
                    report.violations.append(
                        f"{where}: step {doc['step_name']!r} attempt {attempt} recorded "
                        f"{entry['status']} {settled - end} ms after the run ended, before "
                        "its retry (past the documented window)")
    last = done[-1]
    if run_id in cancels and cancels[run_id][0] >= last["before"]:
        return  # cancelled again after the retry: its fence may fail what the retry reopened
    for doc in ev.steps.get(run_id, []):
        error = doc.get("error") or {}
        if doc.get("status") == "failed" and error.get("type") == CANCELLED_ERROR:
            report.violations.append(
                f"{where}: step {doc['step_name']!r} failed by a cancel ({error.get('message')})"
                f" though no cancel came after the retry: the fence of the end the retry "
                "undid failed what the retry reopened")


# --- reopened waits --------------------------------------------------------------------------


def _check_event_waits(db: Any, specs: dict[str, dict[str, Any]], report: Any) -> None:
    """An event wait without a timeout never times out; one with a timeout never before its
    own expiry (a retry reopens it until then, not at once: issue 31, defect 1). A wait a
    fork copied settled in its source (checked there)."""
    from tests.chaos.checker import EVENT_WAIT

    ids = [r for r, s in specs.items() if s.get("kind") == "events"]
    for start in range(0, len(ids), 200):
        for doc in db[keys.STEPS].find({"run_id": {"$in": ids[start:start + 200]},
                                        "step_name": {"$regex": f"^{EVENT_WAIT}"},
                                        "status": "succeeded", "forked_from": None}):
            result = doc.get("result") if isinstance(doc.get("result"), dict) else {}
            if not result.get("timed_out"):
                continue
            expires = (doc.get("data") or {}).get("expires_at_ms")
            where = f"wait {doc['step_name']!r} of events run {doc['run_id']}"
            settled = _settled_ms(doc)
            if expires is None:
                report.violations.append(f"{where} has no timeout, yet it timed out")
            elif settled is not None and settled < expires - SLACK_MS:
                report.violations.append(f"{where} timed out {expires - settled} ms before "
                                         "its own expiry")
            else:
                report.operations["event waits timed out at their expiry"] += 1


def _settled_ms(doc: Doc) -> int | None:
    entry = (doc.get("attempts") or {}).get(str(doc.get("attempt")))
    ended = (entry or {}).get("ended_ms")
    return int(ended) if ended is not None else doc.get("updated_ms")


def _check_approval(run_id: str, spec: dict[str, Any], run: Doc, ops: Operations, ev: Any,
                    report: Any) -> None:
    """The approval run's gate holds a decision the driver recorded (or, in a fork that
    kept decisions, its source's), recorded after the driver gave it; a completed run
    returned it."""
    counts: Counter[str] = report.operations
    gate = next((d for d in ev.steps.get(run_id, []) if d["step_name"] == APPROVAL_GATE), None)
    calls = ops.approvals.get(run_id, [])
    counts["approvals given"] += sum(c["outcome"] == "recorded" for c in calls)
    counts["approvals refused (run ended)"] += sum(c["outcome"] == "run ended" for c in calls)
    where = f"approval run {run_id}"
    if gate is None or gate.get("status") != "succeeded":
        if run.get("status") == "completed":
            report.violations.append(f"{where} completed without its gate decided: {gate}")
        return
    if gate.get("forked_from"):
        counts["approvals kept by a fork"] += 1
        return  # checked against its source (_check_fork)
    given = [c for c in calls if c["outcome"] == "recorded" and c["decision"] == gate.get(
        "result")]
    if not given:
        report.violations.append(f"{where}: its gate holds {gate.get('result')}, a decision "
                                 f"the driver never gave ({[c['decision'] for c in calls]})")
        return
    settled = _settled_ms(gate)
    if settled is not None and settled < given[0]["before"] - SLACK_MS:
        report.violations.append(f"{where}: its gate was decided {given[0]['before'] - settled}"
                                 " ms before the driver gave the decision")
    if any(r["done"] and r["before"] < given[0]["before"] for r in ops.retries.get(run_id, [])):
        counts["approvals waited for again after a retry"] += 1
    if run.get("status") == "completed" and (run.get("output") or {}).get(
            "decision") != gate.get("result"):
        report.violations.append(f"{where} returned {run.get('output')}, its gate decided "
                                 f"{gate.get('result')}")


# --- forks -----------------------------------------------------------------------------------


def _check_fork(db: Any, fork_id: str, fork: Doc, run: Doc, report: Any) -> None:
    counts: Counter[str] = report.operations
    counts["forks"] += 1
    counts["forks keeping decisions" if fork["keep"] else "forks asking decisions again"] += 1
    where = f"fork {fork_id} of run {fork['source']} (from {fork['from_step']!r})"
    if fork["returned"] != fork_id:
        report.violations.append(f"{where}: fork returned {fork['returned']}, not its new id")
    if "repeat" in fork:
        counts["forks repeated"] += 1
        if fork["repeat"] != fork_id:
            report.violations.append(f"{where}: its repeat returned {fork['repeat']}")
    if run.get("forked_from") != fork["source"]:
        report.violations.append(f"{where}: the run names {run.get('forked_from')!r} as its "
                                 "source")
    source = fork["source_steps"]
    names = fork["source_order"]  # the source's steps in the order they were recorded
    before = names[:names.index(fork["from_step"])] if fork["from_step"] in names else []
    copied = list(db[keys.STEPS].find({"run_id": fork_id, "forked_from": {"$ne": None}}))
    counts["steps copied by forks"] += len(copied)
    for doc in copied:
        name, mine = doc["step_name"], source.get(doc["step_name"])
        if doc.get("forked_from") != fork["source"] or name not in before or mine is None:
            report.violations.append(f"{where}: step {name!r} copied from "
                                     f"{doc.get('forked_from')}, not a step of the source "
                                     "recorded before the fork's step")
        elif mine["status"] != "succeeded" or _unseq(mine["result"]) != _unseq(
                doc.get("result")):
            report.violations.append(f"{where}: step {name!r} copied as {doc.get('result')}, "
                                     f"the source's is {mine['status']} {mine['result']}")
        elif name.startswith(GATE_PREFIXES) and not fork["keep"]:
            report.violations.append(f"{where}: the decided gate {name!r} was copied, though "
                                     "the fork did not keep decisions")
    now_steps = step_fingerprints(db, fork["source"])
    changed = sorted(n for n in set(source) | set(now_steps) if source.get(n) != now_steps.get(n))
    if changed:
        report.violations.append(f"{where}: the fork changed its source's steps {changed}")
    if event_fingerprints(db, fork["source"]) != fork["source_events"]:
        report.violations.append(f"{where}: the fork changed its source's events")


def _unseq(result: Any) -> Any:
    """A taken event's result without its seq: the seq is the source's (a copy may keep it
    under another name, so that it hides no event of the fork: issue 31, defect 2)."""
    if isinstance(result, dict):
        return {k: v for k, v in result.items() if k not in ("seq", "forked_seq")}
    return result


def _check_probe(db: Any, probe: Doc, report: Any) -> None:
    """A fork whose new id names another run must be refused, that run left as it was."""
    report.operations["forks naming another run's id (refused)"] += probe["outcome"] == (
        "conflict")
    where = (f"fork of run {probe['source']} from {probe['from_step']!r} under the id of run "
             f"{probe['target']}")
    if probe["outcome"] != "conflict":
        report.violations.append(f"{where}: {probe['outcome']}, not WorkflowRunConflictError")
    now = step_fingerprints(db, probe["target"])
    changed = sorted(n for n in set(now) | set(probe["target_steps"])
                     if now.get(n) != probe["target_steps"].get(n))
    if changed:
        report.violations.append(f"{where}: wrote into that run (steps {changed})")


def _check_no_foreign_copies(db: Any, ops: Operations, report: Any) -> None:
    """A step copied by a fork is found only in a run the driver forked."""
    for doc in db[keys.STEPS].find({"forked_from": {"$ne": None}}, {"run_id": 1,
                                                                     "step_name": 1,
                                                                     "forked_from": 1}):
        if doc["run_id"] not in ops.forks:
            report.violations.append(f"step {doc['step_name']!r} of run {doc['run_id']}, "
                                     f"which is no fork, was copied from {doc['forked_from']}")
