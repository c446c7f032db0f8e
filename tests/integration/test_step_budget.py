"""The round trips of a step, whole system (issue 11): a regression fails here, not in a
benchmark nobody reads. Counts, not time: the same on every machine.

``benchmarks.step_cost`` runs a workflow on the session's real MongoDB and Redis with
every message delivered in order, counting MongoDB commands and the documents they return,
Redis commands and broker messages of the workers and the orchestrator together.

Budget per step, 20 sequential steps, defaults (``continue_in_place``): at most 5 MongoDB
commands (the claim, the claim's read of its run, the settle, the next step's insert; the
run's first read and its final write), at most 3 Redis commands (the step lease; the run
lease taken and handed back) plus the 2 of the run's first pass, at most 4 documents
returned, one broker message. (The claim's read of its run, issue 21: a claim landing inside
a run's end fences itself; see ``tests/unit/test_cancel_windows.py``.)
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.step_cost import Result, measure
from tests.conftest import REDIS_URL


def per_step(result: Result, what: str) -> float:
    return result.per_step(None, what)


def messages(result: Result) -> float:
    return sum(result.messages.values()) / result.steps


def test_a_sequential_step_costs_at_most_5_mongodb_and_3_redis_commands(
        mongo_server: Any) -> None:
    result = measure("sequential", 20, REDIS_URL, mongo_server.url, in_place=True)
    assert per_step(result, "mongo") <= 5.0, result
    assert per_step(result, "redis") <= 3.0 + 2 / 20, result  # + the first pass's 2
    assert per_step(result, "documents") <= 4.0, result
    assert messages(result) <= 1.0, result  # the step's own message: no orchestrator's


def test_with_a_message_per_settle_the_orchestrator_adds_one_read(mongo_server: Any) -> None:
    result = measure("sequential", 20, REDIS_URL, mongo_server.url, in_place=False)
    assert per_step(result, "mongo") <= 5.0 + 2 / 20, result
    assert per_step(result, "redis") <= 3.0 + 2 / 20, result
    assert per_step(result, "documents") <= 4.0 + 2 / 20, result
    assert messages(result) <= 2.0, result


@pytest.mark.parametrize("in_place", [True, False])
def test_a_fan_out_reads_each_settled_step_once(mongo_server: Any, in_place: bool) -> None:
    result = measure("fanout", 100, REDIS_URL, mongo_server.url, in_place=in_place)
    # Claim, the claim's read of its run and settle per step, one more read per step
    # without continue_in_place; the run's first read, the batch insert and the final write
    # spread over the 100 steps.
    assert per_step(result, "mongo") <= (3.05 if in_place else 4.05), result
    assert per_step(result, "documents") <= (3.05 if in_place else 4.05), result
    assert messages(result) <= (1.0 if in_place else 2.0), result
