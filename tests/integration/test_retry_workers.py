"""``pikku.retry`` on real ``celery -A`` workers (issue 25 item 2): a run whose step spent
every attempt fails; retried, the step runs again as its next attempts (its settled Redis
lease freed, its message sent), the steps before it are replayed, not run again, and the
run completes with every attempt in its history."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.integration.test_celery_workers import Cluster, attempts, make_cluster

__all__ = ["make_cluster"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_failed_run_is_retried_to_its_end(make_cluster: Callable[..., Cluster],
                                            broker: str) -> None:
    c = make_cluster(broker)
    c.wait_ready(c.start("retry"))
    # it.flaky fails its first 5 attempts; it has 4 (retries=3).
    run_id = c.pikku.start("pipeline", {"a": 1, "b": 2, "fail": 5})
    run = c.wait(run_id, 30)
    assert run.status == "failed", (run, c.diagnostics())
    assert attempts(c.history(run_id, "flaky")) == [(n, "failed") for n in range(1, 5)]
    summed = c.step(run_id, "sum")
    assert c.pikku.retry(run_id)
    run = c.wait(run_id, 30)
    assert run.status == "completed", (run, c.diagnostics())
    assert run.output["flaky"] == {"ok_on_attempt": 6}
    assert attempts(c.history(run_id, "flaky")) == [
        *((n, "failed") for n in range(1, 6)), (6, "succeeded")]
    assert c.step(run_id, "sum") == summed  # replayed, not run again
