"""``ctx.progress(...)`` (issue 36 item 6), Celery's ``update_state(state="PROGRESS",
meta=...)`` for a step: a bound step says how far it got, fenced like every write of its
attempt, and ``pikku show``, the web API and the dashboard's run page show it while the
step runs."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    PikkuCelery,
    StepContext,
    WorkflowStepSupersededError,
)
from pikku_celery.store.base import NewStep
from pikku_celery.testing import inline
from tests.unit.test_cli import run_cli
from tests.unit.test_contrib import PREFIX, Recorder, make_pikku
from tests.unit.test_dashboard import BASE, Site, site
from tests.unit.test_web_security import framework, web_for

__all__ = ["framework", "site"]  # the fixtures: Flask and Django


def _pikku() -> PikkuCelery:
    return PikkuCelery(Celery(f"progress-{uuid.uuid4().hex[:8]}", broker="memory://"))


def test_a_bound_step_records_its_progress_while_it_runs() -> None:
    pikku = _pikku()
    seen: list[Any] = []
    kits: list[Any] = []

    @pikku.step(name="progress.count", bind=True)
    def count(ctx: StepContext, data: Any) -> int:
        for done in range(1, 4):
            ctx.progress({"done": done, "of": 3})
            seen.append(kits[0].steps(ctx.run_id)["count"].progress)
        return 3

    @pikku.workflow("progress.flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("count", count, data)

    with inline(pikku) as kit:
        kits.append(kit)
        run_id = pikku.start("progress.flow", None)
        assert kit.run(run_id).output == 3
        assert kit.steps(run_id)["count"].progress == {"done": 3, "of": 3}
    assert seen == [{"done": 1, "of": 3}, {"done": 2, "of": 3}, {"done": 3, "of": 3}]


def test_a_superseded_attempt_is_told_by_its_progress() -> None:
    """The store's fence reaches the body: its ``progress`` raises once another attempt
    has the step (``tests/contract/test_store_progress.py`` on every store)."""
    pikku = _pikku()
    kits: list[Any] = []

    @pikku.step(name="progress.lost", bind=True, retries=1)
    def lost(ctx: StepContext, data: Any) -> int:
        if ctx.attempt == 1:
            engine = kits[0].engine
            engine.store.claim_step(ctx.run_id, ctx.step_name, "progress.lost",
                                    engine.now_ms() + 10**9, 1000)
            with pytest.raises(WorkflowStepSupersededError):
                ctx.progress({"done": 1})
            raise RuntimeError("gave up: superseded")
        return ctx.attempt

    @pikku.workflow("progress.lost_flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("lost", lost, data)

    with inline(pikku) as kit:
        kits.append(kit)
        run_id = pikku.start("progress.lost_flow", None)
        assert kit.steps(run_id)["lost"].progress is None


def running_with_progress(pikku: PikkuCelery) -> str:
    """A run whose step ``count`` runs (attempt 1) and has said how far it got."""
    store = pikku.engine.store
    run_id = pikku.start("sum", {"a": 1, "b": 2})
    store.insert_step(NewStep(run_id=run_id, step_name="count", function="contrib.add",
                              max_attempts=4), pikku.engine.now_ms())
    store.claim_step(run_id, "count", "contrib.add", pikku.engine.now_ms(), 60_000)
    store.record_progress(run_id, "count", 1, {"rows": 1200, "of": 5000},
                          pikku.engine.now_ms())
    return run_id


def test_show_prints_a_running_steps_progress() -> None:
    pikku = make_pikku()
    run_id = running_with_progress(pikku)
    result = run_cli(pikku, "show", run_id)
    assert result.exit_code == 0, result.output
    assert "running step" in result.output and "progress" in result.output
    assert '{"rows": 1200, "of": 5000}' in " ".join(result.output.split()), result.output
    shown = json.loads(run_cli(pikku, "show", run_id, "--json").output)
    [step] = [s for s in shown["steps"] if s["step_name"] == "count"]
    assert step["progress"] == {"rows": 1200, "of": 5000} and step["progress_at"]


def test_the_api_serves_progress_through_the_redact_hook(framework: str) -> None:
    told: list[str] = []

    def redact(value: Any, where: str) -> Any:
        told.append(where)
        return {"hidden": True} if where == "step_progress" else value

    pikku = PikkuCelery(Celery("progress-api", broker="memory://", set_as_current=False),
                        store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False, redact_value=redact)
    pikku.engine.dispatcher = Recorder()
    add = pikku.step(name="contrib.add")(lambda data: data["a"] + data["b"])
    pikku.workflow("sum")(lambda wf, data: wf.do("add", add, data))
    run_id = running_with_progress(pikku)
    web = web_for(framework, pikku)
    status, served = web.call("GET", f"{PREFIX}/runs/{run_id}/steps/count", user="admin")
    assert status == 200, served
    assert served["progress"] == {"hidden": True} and "step_progress" in told


def test_the_run_page_shows_a_running_steps_progress(site: Site) -> None:
    run_id = running_with_progress(site.pikku)
    page = site.get(f"{BASE}runs/{run_id}")
    assert page.status == 200
    found = re.search(r'<table class="grid" id="step-progress">(.*?)</table>', page.text, re.S)
    assert found is not None, page.text
    assert 'data-step="count"' in found.group(1)
    assert "&#34;rows&#34;: 1200" in found.group(1) or "&quot;rows&quot;: 1200" in found.group(1)
