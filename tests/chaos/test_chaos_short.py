"""The short chaos profile: same harness and checker as the full run (docs/reliability.md),
fewer runs and faults, on a real 3-node mongod replica set. Runs in a subprocess so its
environment and processes are its own.

On the Redis broker it runs in CI on every change (``./dev test``). On RabbitMQ it runs under
``./dev chaos`` (marker ``dev_chaos``; deselected from ``./dev test``): the harness, the
faults and the checker are the same on both brokers, and RabbitMQ on real workers stays in
CI: tests/integration/test_celery_workers.py (a run end to end on both pools, a retried step
included; a worker SIGKILLed mid-step, its step run again as attempt 2),
test_workflow_features.py (a graph with every feature) and test_non_interference.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("broker", [
    "redis",
    pytest.param("amqp", marks=pytest.mark.dev_chaos),  # ./dev chaos
])
def test_short_chaos_profile_finds_no_violation(broker: str) -> None:
    seed = os.environ.get("PIKKU_CHAOS_SEED", "20261130")
    done = subprocess.run(
        [sys.executable, "-m", "tests.chaos.run", "--profile", "short", "--seed", seed,
         "--broker", broker], cwd=ROOT, capture_output=True, text=True, timeout=380)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "violations 0" in out and "lost or stuck runs 0" in out
    assert "double-recorded outcomes 0" in out
    # The run exercised the fence (the checker also fails a run that did not): late writes
    # were refused and workers were paused.
    refused = re.search(r"late writes refused (\d+) \(landing before the newer attempt "
                        r"settled: (\d+)\)", out)
    assert refused and int(refused[1]) > 0, out[-3000:]
    assert re.search(r"(pause_worker|stale_write) [1-9]", out), out[-3000:]
    # The replica set lost its primary each way (killed, stepped down, stalled past the
    # election timeout), and a writable primary came back every time.
    faults = re.search(r"^faults \d+: (.*)$", out, re.M)
    assert faults, out[-3000:]
    for kind in ("kill_primary", "step_down_primary", "stall_primary"):
        assert re.search(rf"\b{kind} [1-9]", faults[1]), out[-3000:]
        assert re.search(rf"^after {kind}: writable primary n=[1-9]", out, re.M), out[-3000:]
    # Issue 21's cancel windows were aimed at: a cancel racing a step's delivery, and one
    # landing while a pass created a child run; the checker held every ended run (and every
    # child of a cancelled run) to "no outcome recorded after the end, beyond the window".
    for kind in ("cancel_racing_claim", "cancel_during_child"):
        assert re.search(rf"\b{kind} [1-9]", faults[1]), out[-3000:]
    assert re.search(r"^outcomes recorded after their run ended \d+ of [1-9]", out,
                     re.M), out[-3000:]
    # (the child is cancelled, or was never created when a fault stopped the paused pass)
    assert re.search(r"^children of cancelled runs: (?!none)", out, re.M), out[-3000:]
    # Issue 26's primitives were in the mix and held to their invariants: events taken both
    # ways (sent before the run waited, and while it waited), keyed sends repeated, timeouts
    # that passed; the schedule's ticks ran; limited runs waited queued for their key's
    # slot; transactional bookings were checked against the recorded attempts.
    events = re.search(r"^events: (.*)$", out, re.M)
    assert events, out[-3000:]
    for figure in ("runs completed", "keyed sends repeated", "waits timed out",
                   "taken, sent before the run waited", "taken, sent while the run waited"):
        assert re.search(rf"\b{figure} [1-9]", events[1]), out[-3000:]
    assert re.search(r"^schedule ticks: runs \d+, completed [1-9]", out, re.M), out[-3000:]
    assert re.search(r"^concurrency-limited runs: .*waited for a slot [1-9]", out,
                     re.M), out[-3000:]
    assert re.search(r"^transactional bookings: steps [1-9]\d*, bookings [1-9]", out,
                     re.M), out[-3000:]
    # Issue 31's operations were in the mix and held to contract section 7: failed and
    # cancelled runs retried (an events run and an approval run cancelled while they wait,
    # a limited run cancelled while queued: each retried), completed runs forked with and
    # without keep_decisions, forks repeated and forks under another run's id refused, and
    # the limit sampled during the faults.
    ops = re.search(r"^retries and forks: (.*)$", out, re.M)
    assert ops, out[-3000:]
    # (a retried run may be cancelled again by the driver or a fault: any end its spec
    # allows, which the checker holds it to)
    for figure in ("runs retried", r"events runs retried after cancelled, then \w+",
                   r"approver runs retried after cancelled, then \w+",
                   r"limited runs retried after cancelled, then \w+",
                   "forks",
                   "forks keeping decisions", "forks asking decisions again",
                   "steps copied by forks", "forks repeated",
                   r"forks naming another run's id \(refused\)", "limit samples"):
        assert re.search(rf"\b{figure} [1-9]", ops[1]), (figure, out[-3000:])
