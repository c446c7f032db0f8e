"""Issue 22's web items, each on Flask and Django where it applies: what a caller may read
(item 2), no trust in loopback (3), waitress (5), the start oracle (6), paged reads (7),
the token kept out of logs and ``ps`` (8), cookies (9), fixed notices (10), the gate told
to ``authorize`` (12), default isolation (13), and ``pikku check`` reporting each."""

from __future__ import annotations

import http.client
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from pikku_celery import (
    InMemoryLeaseService,
    MongoWorkflowStore,
    PikkuCelery,
    PikkuConfigurationError,
)
from pikku_celery.dashboard import standalone
from pikku_celery.operate.cli import pikku as pikku_group
from pikku_celery.store.base import NewRun, NewStep
from tests.conftest import pooled_database
from tests.support.operate import now_ms
from tests.unit.test_contrib import PREFIX, Web, django_web, flask_web, make_pikku
from tests.unit.test_contrib_flask import CeleryCLIContext
from tests.unit.test_dashboard import BASE, Site, django_site, flask_site, rows

OWNERS = {"ann-1": "ann", "bob-1": "bob", "ann-2": "ann", "bob-2": "bob"}


def user_of(request: Any) -> str | None:
    if hasattr(request, "user"):  # Django
        return request.user.username if request.user.is_authenticated else None
    from flask import session

    return session.get("user")


def owner_rule(request: Any, action: str, run_id: str | None) -> bool:
    """A per-run read rule: anyone signed in may list; a run only if it is theirs."""
    if action != "read":
        return user_of(request) == "admin"
    return run_id is None or OWNERS.get(run_id) == user_of(request)


def my_runs(request: Any) -> dict[str, Any]:
    return {"input.owner": user_of(request)}


@pytest.fixture(params=["memory", "mongod"])
def owned(request: pytest.FixtureRequest) -> Iterator[PikkuCelery]:
    """Four runs, two of ann's and two of bob's, newest last."""
    def fill(pikku: PikkuCelery) -> PikkuCelery:
        for i, (run_id, owner) in enumerate(OWNERS.items()):
            pikku.engine.store.create_run(NewRun(run_id, "sum", {"owner": owner}), 1000 + i)
        return pikku

    if request.param == "memory":
        yield fill(make_pikku())
        return
    with pooled_database(request.getfixturevalue("mongo_server")) as db:
        pikku = make_pikku()
        pikku.engine.store = MongoWorkflowStore(db)
        yield fill(pikku)


@pytest.fixture(params=["flask", "django"])
def framework(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def web_for(framework: str, pikku: PikkuCelery, **settings: Any) -> Web:
    named = {f"PIKKU_{k}": v for k, v in settings.items()}
    if framework == "flask":
        return flask_web(pikku, **named)
    web = django_web(pikku, **named)
    from django.contrib.auth.models import User

    for name in ("ann", "bob"):
        User.objects.get_or_create(username=name)
    return web


def site_for(framework: str, pikku: PikkuCelery, **settings: Any) -> Site:
    named = {f"PIKKU_{k}": v for k, v in settings.items()}
    if framework == "flask":
        return flask_site(pikku, **named)
    site = django_site(pikku, **named)
    from django.contrib.auth.models import User

    for name in ("ann", "bob"):
        User.objects.get_or_create(username=name)
    return site


# --- item 2: the listing serves only what the caller may read ---------------------------------


def listed(web: Web, user: str, query: str = "") -> tuple[list[str], Any]:
    status, payload = web.call("GET", PREFIX + "/runs" + query, user=user)
    assert status == 200, payload
    return [r["run_id"] for r in payload["runs"]], payload["next"]


def test_a_per_run_read_rule_holds_for_the_listing(owned: PikkuCelery, framework: str) -> None:
    web = web_for(framework, owned, AUTHORIZE=owner_rule)
    assert listed(web, "ann")[0] == ["ann-2", "ann-1"]
    assert listed(web, "bob")[0] == ["bob-2", "bob-1"]
    # the cursor of someone else's run is unknown to the caller
    assert web.call("GET", PREFIX + "/runs?before=bob-2", user="ann")[0] == 404
    site = site_for(framework, owned, AUTHORIZE=owner_rule)
    assert rows(site.get(BASE, user="ann")) == ["ann-2", "ann-1"]
    assert site.get(f"{BASE}?before=bob-2", user="ann").status == 404
    assert site.get(f"{BASE}runs/bob-1", user="ann").status == 403


def test_a_run_filter_is_a_store_query_for_pages_cursors_and_counts(
        owned: PikkuCelery, framework: str) -> None:
    web = web_for(framework, owned, AUTHORIZE=owner_rule, RUN_FILTER=my_runs)
    assert listed(web, "ann", "?limit=1") == (["ann-2"], "ann-2")  # a full page of hers
    assert listed(web, "ann", "?limit=1&before=ann-2") == (["ann-1"], "ann-1")
    assert web.call("GET", PREFIX + "/runs/bob-1", user="ann")[0] in (403, 404)
    site = site_for(framework, owned, AUTHORIZE=owner_rule, RUN_FILTER=my_runs)
    page = site.get(BASE, user="bob")
    assert rows(page) == ["bob-2", "bob-1"]
    assert 'id="count-running">2<' in page.text.replace(" ", "") or ">2<" in page.text


def test_a_run_filter_alone_makes_other_runs_unknown(owned: PikkuCelery, framework: str) -> None:
    web = web_for(framework, owned, RUN_FILTER="tests.unit.test_web_security:my_runs")
    assert web.call("GET", PREFIX + "/runs/bob-1", user="admin")[0] == 404
    owned.engine.store.create_run(NewRun("admin-1", "sum", {"owner": "admin"}), 2000)
    assert listed(web, "admin")[0] == ["admin-1"]


# --- item 3: no allow-local ------------------------------------------------------------------


def test_allow_local_is_refused_with_what_to_use_instead(framework: str) -> None:
    pikku = make_pikku()
    if framework == "flask":
        with pytest.raises(PikkuConfigurationError) as refused:
            flask_web(pikku, PIKKU_AUTHORIZE="allow-local")
        assert "loopback is not an identity" in str(refused.value)
        return
    web = django_web(pikku, PIKKU_AUTHORIZE="allow-local")
    assert web.call("GET", PREFIX + "/runs", user=None)[0] == 500  # never let in
    from django.test import override_settings

    from pikku_celery.contrib.django.apps import check_settings
    with override_settings(PIKKU_AUTHORIZE="allow-local"):
        assert any("loopback is not an identity" in m.msg for m in check_settings())


def test_the_standalone_app_needs_a_token_or_authorize() -> None:
    with pytest.raises(ValueError, match="loopback is not an identity"):
        standalone.make_app(make_pikku())
    app = standalone.make_app(make_pikku(), token="t" * 20, plain_http=True)
    local = app.test_client()
    assert local.get("/", environ_base={"REMOTE_ADDR": "127.0.0.1"}).status_code == 401


# --- items 3, 5, 8, 9: `pikku dashboard` on waitress -------------------------------------------


class Served:
    """``pikku dashboard`` run by click in a thread, its waitress server caught."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *args: str,
                 env: dict[str, str | None] | None = None) -> None:
        self.server: Any = None
        ready = threading.Event()
        real = standalone.create_server

        def caught(app: Any, host: str, port: int) -> Any:
            self.server = real(app, host, 0)
            ready.set()
            return self.server

        monkeypatch.setattr(standalone, "create_server", caught)
        pikku = make_pikku()
        self.result: Any = None

        def run() -> None:
            self.result = CliRunner().invoke(pikku_group, ["dashboard", *args],
                                             obj=CeleryCLIContext(pikku.app), env=env or {})
            ready.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(60), "the dashboard never started"

    def get(self, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
        connection = http.client.HTTPConnection("127.0.0.1", self.server.effective_port,
                                                timeout=30)
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        response.read()
        connection.close()
        return response

    def stop(self) -> str:
        self.server.close()
        self.thread.join(60)
        assert not self.thread.is_alive()
        return str(self.result.output)


def test_pikku_dashboard_serves_on_waitress_with_a_token_printed_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    drawn = "drawn-" + "d" * 30
    monkeypatch.setattr(standalone, "new_token", lambda: drawn)
    with caplog.at_level(logging.INFO, logger="pikku_celery.dashboard.access"):
        served = Served(monkeypatch, env={"PIKKU_DASHBOARD_TOKEN": None})
        from waitress.server import BaseWSGIServer

        assert isinstance(served.server, BaseWSGIServer)
        adj = served.server.adj
        assert (adj.connection_limit, adj.channel_timeout, adj.threads) == (
            standalone.CONNECTION_LIMIT, standalone.CHANNEL_TIMEOUT_S, standalone.THREADS)
        assert served.get("/api/runs").status == 401  # loopback alone lets nobody in
        assert served.get(f"/?token={drawn}").status == 303
        assert served.get("/api/runs", {"Authorization": f"Bearer {drawn}"}).status == 200
    assert drawn not in caplog.text and "token=***" in caplog.text
    output = served.stop()
    assert output.count(f"?token={drawn}") == 1


def test_the_printed_token_lets_in_and_sets_a_safe_cookie(monkeypatch: pytest.MonkeyPatch) -> None:
    app = standalone.make_app(make_pikku(), token="k" * 24, plain_http=True)
    client = app.test_client()
    login = client.get("/?token=" + "k" * 24)
    assert login.status_code == 303 and login.headers["Location"] == "/"
    cookie = login.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Secure" not in cookie
    assert client.get("/api/runs").status_code == 200
    secure = standalone.make_app(make_pikku(), token="k" * 24).test_client()
    assert "Secure" in secure.get("/?token=" + "k" * 24).headers["Set-Cookie"]


def test_the_token_comes_from_the_environment_only(monkeypatch: pytest.MonkeyPatch) -> None:
    pikku = make_pikku()
    result = CliRunner().invoke(pikku_group, ["dashboard", "--token", "x" * 20],
                                obj=CeleryCLIContext(pikku.app))
    assert result.exit_code == 1 and "PIKKU_DASHBOARD_TOKEN" in result.output
    assert "x" * 20 not in result.output
    refused = CliRunner().invoke(pikku_group, ["dashboard", "--host", "0.0.0.0"],
                                 obj=CeleryCLIContext(pikku.app),
                                 env={"PIKKU_DASHBOARD_TOKEN": None})
    assert refused.exit_code == 1 and "PIKKU_DASHBOARD_TOKEN" in refused.output


def test_an_environment_token_is_used_and_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    token = "env-token-" + "z" * 20
    served = Served(monkeypatch, env={"PIKKU_DASHBOARD_TOKEN": token})
    assert served.get("/api/runs", {"Authorization": f"Bearer {token}"}).status == 200
    assert served.get("/api/runs").status == 401
    assert token not in served.stop()


def test_redact_tokens_masks_every_token_value() -> None:
    record = logging.LogRecord("gunicorn.access", logging.INFO, "", 0,
                               '"GET /?a=1&token=%s HTTP/1.1" 303', ("s3cr3t",), None)
    standalone.RedactTokens().filter(record)
    assert "s3cr3t" not in record.getMessage() and "token=***" in record.getMessage()


# --- item 6: no oracle on others' input ------------------------------------------------------


def start_only(request: Any, action: str, run_id: str | None) -> bool:
    return user_of(request) is not None and action == "start"


def test_a_start_only_caller_learns_nothing_of_an_existing_run(framework: str) -> None:
    pikku = make_pikku()
    pikku.start("sum", {"a": 1, "b": 2}, run_id="secret-run")
    web = web_for(framework, pikku, AUTHORIZE=start_only)
    url = PREFIX + "/workflows/sum/runs"
    same = web.call("POST", url, {"input": {"a": 1, "b": 2}, "run_id": "secret-run"},
                    user="reader")
    other = web.call("POST", url, {"input": {"a": 9, "b": 2}, "run_id": "secret-run"},
                     user="reader")
    assert same[0] == other[0] == 409 and same[1] == other[1]
    assert web.call("POST", url, {"input": {"a": 1, "b": 2}, "run_id": "new-run"},
                    user="reader")[0] == 202


# --- item 7: paged reads -----------------------------------------------------------------------


def many_steps(pikku: PikkuCelery, count: int) -> str:
    store = pikku.engine.store
    store.create_run(NewRun("big", "sum", None), now_ms())
    for i in range(count):
        store.insert_step(NewStep("big", f"s{i:04d}", "contrib.add", data={"v": "x" * 100}),
                          now_ms())
    return "big"


def test_steps_and_history_are_paged_and_carry_no_values(framework: str) -> None:
    pikku = make_pikku()
    many_steps(pikku, 250)
    web = web_for(framework, pikku)
    status, first = web.call("GET", PREFIX + "/runs/big/steps")
    assert status == 200 and len(first["steps"]) == 100 and first["next"] == "s0099"
    assert "data" not in first["steps"][0]
    names = [s["step_name"] for s in first["steps"]]
    after = first["next"]
    while after:
        page = web.call("GET", PREFIX + f"/runs/big/steps?after={after}&limit=500")[1]
        names += [s["step_name"] for s in page["steps"]]
        after = page["next"]
    assert names == [f"s{i:04d}" for i in range(250)]
    assert web.call("GET", PREFIX + "/runs/big/steps/s0007")[1]["data"] == {"v": "x" * 100}
    assert web.call("GET", PREFIX + "/runs/big/history?limit=2")[0] == 200
    assert web.call("GET", PREFIX + "/runs/big/steps?limit=501")[0] == 400


def test_the_run_page_shows_a_page_of_steps(framework: str) -> None:
    pikku = make_pikku()
    many_steps(pikku, 150)
    site = site_for(framework, pikku)
    first = site.get(f"{BASE}runs/big")
    assert first.status == 200 and "100 of 150 steps" in first.text
    assert 'data-step="s0099"' in first.text and 'data-step="s0100"' not in first.text
    later = site.get(f"{BASE}runs/big?steps_after=s0099")
    assert 'data-step="s0100"' in later.text and 'data-step="s0099"' not in later.text


# --- item 10: fixed notices ----------------------------------------------------------------


def test_a_notice_is_a_code_never_text_from_the_address(framework: str) -> None:
    pikku = make_pikku()
    run_id = pikku.start("waits", None, inline=True)
    site = site_for(framework, pikku)
    spoofed = site.get(f"{BASE}runs/{run_id}?notice=Your+account+is+locked")
    assert spoofed.status == 200 and "account is locked" not in spoofed.text
    assert 'id="notice"' not in spoofed.text
    assert "run resumed" in site.get(f"{BASE}runs/{run_id}?notice=resumed").text


# --- item 12: the gate ---------------------------------------------------------------------


gates_asked: list[Any] = []


def gate_rule(request: Any, action: str, run_id: str | None, *, gate: str | None = None
              ) -> bool:
    gates_asked.append((action, gate))
    return action != "approve" or gate == "go"


def test_authorize_is_told_the_gate_of_an_approval(framework: str) -> None:
    from tests.unit.test_contrib import with_an_open_gate

    pikku = with_an_open_gate(make_pikku())
    run_id = pikku.start("open", None, inline=True)
    web = web_for(framework, pikku, AUTHORIZE=gate_rule)
    gates_asked.clear()
    refused = web.call("POST", PREFIX + f"/runs/{run_id}/approvals/finance",
                       {"decision": True})
    assert refused[0] == 403 and ("approve", "finance") in gates_asked
    allowed = web.call("POST", PREFIX + f"/runs/{run_id}/approvals/go", {"decision": True})
    assert allowed[0] == 200, allowed
    assert ("approve", "go") in gates_asked
    assert ("read", None) not in [g for g in gates_asked if g[0] == "approve"]


# --- item 13 and `pikku check` -----------------------------------------------------------------


def test_default_isolation_is_reported_by_check_and_at_worker_start(
        mongo_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    from celery import Celery

    from pikku_celery.model._isolation import warn_at_worker_start

    url = mongo_server.url.split("?")[0].rstrip("/") + "/"
    celery_app = Celery("proj", broker="memory://", set_as_current=False)
    celery_app.conf.pikku_mongo_url = url  # no database named: 'pikku'
    pikku = PikkuCelery(celery_app, leases=InMemoryLeaseService(), worker_reaper=False)
    pikku.engine.leases.key_prefix = "proj"  # what a RedisLeaseService adopts
    result = CliRunner().invoke(pikku_group, ["check"], obj=CeleryCLIContext(celery_app))
    assert "default MongoDB database 'pikku'" in result.output and result.exit_code == 1
    with caplog.at_level(logging.WARNING, logger="pikku_celery"):
        warn_at_worker_start(celery_app)
    assert "reads these runs" in caplog.text
    celery_app.conf.pikku_key_prefix = "proj-billing"
    result = CliRunner().invoke(pikku_group, ["check"], obj=CeleryCLIContext(celery_app))
    assert "default MongoDB database" not in result.output


def test_check_reports_insecure_web_settings(framework: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIKKU_DASHBOARD_TOKEN", "short")
    if framework == "flask":
        from flask import Flask

        from pikku_celery.contrib.flask import PikkuFlask, web_problems

        app = Flask("check-test")
        app.config.update(PIKKU_URL_PREFIX=None, SESSION_COOKIE_SAMESITE=None)
        PikkuFlask(make_pikku()).init_app(app)
        found = web_problems(app)
        assert any("SESSION_COOKIE_SECURE" in p for p in found)
        assert any("SAMESITE" in p for p in found)
        result = CliRunner().invoke(app.cli, ["pikku", "check"])
    else:
        from django.test import override_settings

        django_web(make_pikku())  # sets Django up
        from pikku_celery.contrib.django.management.commands.pikku import web_problems
        with override_settings(DEBUG=False, PIKKU_AUTHORIZE="allow-local",
                               SESSION_COOKIE_SECURE=False):
            found = web_problems()
        assert any("allow-local" in p for p in found)
        assert any("SESSION_COOKIE_SECURE" in p for p in found)
        return
    assert "insecure: PIKKU_DASHBOARD_TOKEN has fewer than 16" in result.output
