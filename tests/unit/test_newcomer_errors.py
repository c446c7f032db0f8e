"""Errors and log lines that tell a newcomer what went wrong (issue 25 item 6): a Redis that
does not answer is named (``pikku.start`` and every lease call raise
``RedisUnreachableError`` naming the server and the setting, still a redis-py
``ConnectionError``, never the password); an unknown workflow lists the known ones, or says
that none was imported and how to import them; a copy refused at the step lease says why
and what happens next."""

from __future__ import annotations

import socket

import pytest
import redis
from celery import Celery

from pikku_celery import PikkuCelery, RedisLeaseService
from pikku_celery.leases import RedisUnreachableError
from pikku_celery.store.memory import InMemoryWorkflowStore


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_start_with_redis_down_names_redis_and_the_setting() -> None:
    port = _closed_port()
    leases = RedisLeaseService.from_url(f"redis://:s3cret@127.0.0.1:{port}/3")
    pikku = PikkuCelery(Celery("outage", broker="memory://"), store=InMemoryWorkflowStore(),
                        leases=leases, worker_reaper=False)
    pikku.workflow("flow")(lambda wf, data: data)
    with pytest.raises(RedisUnreachableError) as raised:
        pikku.start("flow", None)
    message = str(raised.value)
    assert f"Redis at redis://127.0.0.1:{port}/3 is unreachable" in message, message
    assert "pikku_redis_url" in message and "s3cret" not in message
    assert isinstance(raised.value, redis.exceptions.ConnectionError)


@pytest.mark.parametrize("call", ["acquire", "acquire_or_mark", "now_ms", "get"])
def test_every_lease_call_names_the_server(call: str) -> None:
    leases = RedisLeaseService.from_url(f"redis://127.0.0.1:{_closed_port()}/0")
    args = {"acquire": ("k", "h", 1000), "acquire_or_mark": ("k", "h", 1000, "m"),
            "now_ms": (), "get": ("k",)}[call]
    with pytest.raises(RedisUnreachableError, match="is unreachable"):
        getattr(leases, call)(*args)


def test_an_unknown_workflow_names_the_known_ones_or_says_none_was_imported() -> None:
    import pickle

    from pikku_celery.model.errors import WorkflowNotFoundError

    pikku = PikkuCelery(Celery("nf", broker="memory://"), store=InMemoryWorkflowStore(),
                        leases=RedisLeaseService.from_url("redis://127.0.0.1:6379/0"),
                        worker_reaper=False)
    pikku.registry.workflows.clear()  # no shared workflow another test module bound here
    with pytest.raises(WorkflowNotFoundError) as none:
        pikku.start("checkout", None)
    assert "INSTALLED_APPS" in str(none.value) and "pikku_celery.contrib.django" in str(
        none.value)
    pikku.workflow("shipping")(lambda wf, data: data)
    with pytest.raises(WorkflowNotFoundError) as typo:
        pikku.start("shiping", None)
    assert "(registered: 'shipping')" in str(typo.value)
    assert WorkflowNotFoundError("x", []).known == ()
    again = pickle.loads(pickle.dumps(typo.value))  # Celery round-trips errors by args
    assert str(again) == str(typo.value)


def test_a_copy_refused_at_the_lease_says_why_and_what_happens_next(
        caplog: pytest.LogCaptureFixture) -> None:
    from pikku_celery import InMemoryLeaseService
    from pikku_celery.model import keys

    app = Celery("dup", broker="memory://")
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False, in_place_steps=0)
    sent: list[tuple[str, str]] = []

    class Keep:
        def dispatch_step(self, function: str, run_id: str, step_name: str) -> None:
            sent.append((run_id, step_name))

        def wake_run(self, *args: object, **kwargs: object) -> None:
            pass

        def arm_timer(self, *args: object) -> None:
            pass

    pikku.engine.dispatcher = Keep()
    step = pikku.step(name="dup.step")(lambda data: data)
    pikku.workflow("dup.flow")(lambda wf, data: wf.do("s", step, data))
    run_id = pikku.start("dup.flow", 1)
    pikku.engine.advance(run_id)
    assert sent == [(run_id, "s")]
    # A live worker holds the step.
    assert pikku.engine.leases.acquire(keys.step_lease_key(run_id, "s"), "x:dup.step",
                                       60_000)
    with caplog.at_level("INFO", logger="pikku_celery"):
        result = app.tasks["dup.step"].apply(args=(run_id, "s"), task_id="copy-1")
    assert result.state == "IGNORED"
    line = next(r.getMessage() for r in caplog.records if "ran nothing" in r.getMessage())
    assert run_id in line and "copy-1" in line and "reaper runs the step again" in line
