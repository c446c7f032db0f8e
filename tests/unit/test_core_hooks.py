"""The core's seams of issue 23: ``start_on_commit`` waits for a commit through the hook a
web framework's adapter registers (``pikku_celery.worker.on_commit``; the core imports no
adapter), and ``list_runs``/``count_runs`` pass the store's ``match``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.model.errors import PikkuConfigurationError
from pikku_celery.worker import on_commit
from tests.unit.test_engine import Recorder


@pytest.fixture
def pikku() -> PikkuCelery:
    made = PikkuCelery(Celery("hooks", set_as_current=False), store=InMemoryWorkflowStore(),
                       leases=InMemoryLeaseService(), worker_reaper=False)
    made.engine.dispatcher = Recorder()
    made.workflow("hooks.echo")(lambda wf, data: data)
    return made


def test_without_an_adapter_start_on_commit_names_the_app_to_install(
        pikku: PikkuCelery, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(on_commit, "_registered", [])
    monkeypatch.setattr(on_commit, "_record_start", [])  # Django's, if loaded here
    with pytest.raises(PikkuConfigurationError, match=r"pikku_celery\.contrib\.django"):
        pikku.start_on_commit("hooks.echo", {"n": 1})
    assert pikku.list_runs() == []


def test_start_on_commit_starts_when_the_registered_hook_says_so(
        pikku: PikkuCelery, monkeypatch: pytest.MonkeyPatch) -> None:
    waiting: list[tuple[Callable[[], object], str | None]] = []
    monkeypatch.setattr(on_commit, "_registered", [])
    monkeypatch.setattr(on_commit, "_record_start", [])  # Django's, if loaded here
    on_commit.register(lambda start, using: waiting.append((start, using)))
    run_id = pikku.start_on_commit("hooks.echo", {"n": 1}, run_id="oc-hook", using="other")
    assert run_id == "oc-hook" and pikku.list_runs() == []
    with pytest.raises(Exception, match="nope"):  # checked before the commit, not after
        pikku.start_on_commit("nope", {})
    assert len(waiting) == 1 and waiting[0][1] == "other"
    waiting[0][0]()  # the commit
    assert pikku.get_run("oc-hook").input == {"n": 1}


def test_list_and_count_runs_pass_match_to_the_store(pikku: PikkuCelery) -> None:
    for owner in ("ann", "bob", "ann"):
        pikku.start("hooks.echo", {"owner": owner})
    match: dict[str, Any] = {"input.owner": "ann"}
    assert [r.input for r in pikku.list_runs(match=match)] == [{"owner": "ann"}] * 2
    assert pikku.count_runs("running", match=match) == 2
    assert pikku.count_runs("running") == 3
