"""The Flask extension: ``PikkuFlask(pikku=None)`` + ``init_app`` in app factories, the
refusal to mount the API without ``PIKKU_AUTHORIZE``, settings handed to
the Celery app, ``flask pikku`` and the shared ``pikku`` command group."""

from __future__ import annotations

import json
import logging
from typing import Any

import click
import pytest
from celery import Celery
from click.testing import CliRunner
from flask import Flask, abort

from pikku_celery import PikkuCelery, PikkuConfigurationError, PikkuError
from pikku_celery.contrib.flask import PikkuFlask, current_pikku
from pikku_celery.operate.cli import pikku as pikku_group
from tests.unit.test_contrib import PREFIX, make_pikku


def factory(ext: PikkuFlask, celery_app: Celery | None = None, **config: Any) -> Flask:
    """An app factory as Flask's guides write one."""
    app = Flask("factory")
    app.config.update(SECRET_KEY="tests", **config)
    if celery_app is not None:
        app.extensions["celery"] = celery_app
    ext.init_app(app)
    return app


def allow_all(request: Any, action: str, run_id: str | None) -> bool:
    return True


def test_mounting_the_api_without_authorize_is_refused_with_how_to_fix_it() -> None:
    with pytest.raises(PikkuError) as refused:
        factory(PikkuFlask(make_pikku()))
    message = str(refused.value)
    assert "PIKKU_AUTHORIZE" in message and "(request, action, run_id)" in message
    assert "flask pikku dashboard" in message and "PIKKU_URL_PREFIX = None" in message
    # no API: nothing to authorize, the app still gets current_pikku and the commands
    pikku = make_pikku()
    app = factory(PikkuFlask(pikku), PIKKU_URL_PREFIX=None)
    with app.app_context():
        assert current_pikku() is pikku
    assert app.test_client().get(PREFIX + "/runs").status_code == 404


def test_one_extension_serves_many_apps_of_a_factory() -> None:
    ext = PikkuFlask()  # module level in a real app
    first, second = make_pikku(), make_pikku()
    app1 = factory(ext, first.app, PIKKU_AUTHORIZE=allow_all)
    app2 = factory(ext, second.app, PIKKU_AUTHORIZE=allow_all, PIKKU_URL_PREFIX="/ops/wf")
    first.start("sum", {"a": 1, "b": 1}, run_id="one")
    second.start("sum", {"a": 2, "b": 2}, run_id="two")
    assert [r["run_id"] for r in app1.test_client().get(PREFIX + "/runs").json["runs"]] \
        == ["one"]
    assert [r["run_id"] for r in app2.test_client().get("/ops/wf/api/runs").json["runs"]] \
        == ["two"]
    with app2.app_context():
        assert current_pikku() is second


def test_a_celery_app_without_pikku_gets_one_configured_from_the_flask_config() -> None:
    celery_app = Celery("flask-lazy", broker="memory://", set_as_current=False)
    celery_app.conf.pikku_key_prefix = "from-celery"  # the Celery app's own setting wins
    app = factory(PikkuFlask(), celery_app, PIKKU_AUTHORIZE=allow_all,
                  PIKKU_IDENTIFY="tests.unit.test_contrib_flask:by_header",
                  PIKKU_MONGO_URL="mongodb://db.example/shop", PIKKU_KEY_PREFIX="from-flask",
                  PIKKU_STEP_LEASE="20s")
    with app.app_context():
        pikku = current_pikku()
    assert isinstance(pikku, PikkuCelery) and celery_app.pikku is pikku
    assert celery_app.conf.pikku_mongo_url == "mongodb://db.example/shop"
    assert celery_app.conf.pikku_step_lease == "20s"
    assert celery_app.conf.pikku_key_prefix == "from-celery"
    assert celery_app.conf.get("pikku_authorize") is None  # web settings stay in Flask
    assert celery_app.conf.get("pikku_identify") is None


def test_the_celery_app_can_be_named_in_the_config() -> None:
    pikku = make_pikku()
    app = factory(PikkuFlask(), PIKKU_AUTHORIZE=allow_all, PIKKU_CELERY_APP=pikku.app)
    with app.app_context():
        assert current_pikku() is pikku
    with pytest.raises(PikkuError, match=r"app.extensions\['celery'\]"):
        factory(PikkuFlask(), PIKKU_AUTHORIZE=allow_all)


def test_authorize_may_be_a_dotted_path_and_may_abort_with_401() -> None:
    pikku = make_pikku()
    app = factory(PikkuFlask(pikku), PIKKU_AUTHORIZE="tests.unit.test_contrib_flask:bearer")
    client = app.test_client()
    response = client.get(PREFIX + "/runs")
    assert (response.status_code, response.json["error"]) == (401, "NotAuthenticated")
    assert client.get(PREFIX + "/runs", headers={"Authorization": "Bearer wrong"}
                      ).status_code == 403
    assert client.get(PREFIX + "/runs", headers={"Authorization": "Bearer good"}
                      ).status_code == 200
    with pytest.raises(ImportError, match="PIKKU_AUTHORIZE"):
        factory(PikkuFlask(pikku), PIKKU_AUTHORIZE="tests.nowhere:allow")


def bearer(request: Any, action: str, run_id: str | None) -> bool:
    header = request.headers.get("Authorization")
    if header is None:
        abort(401)
    return bool(header == "Bearer good")


def by_header(request: Any) -> Any:
    """A ``PIKKU_IDENTIFY``: the caller a (trusted, in this test) header names."""
    name = request.headers.get("X-User")
    if name == "nobody-at-all":
        abort(401)
    return None if name is None else (42 if name == "not-a-name" else name)


def test_identify_may_be_a_dotted_path_and_names_the_approver() -> None:
    pikku = make_pikku()
    run_id = pikku.start("gated", None, inline=True)
    app = factory(PikkuFlask(pikku), PIKKU_AUTHORIZE=allow_all,
                  PIKKU_IDENTIFY="tests.unit.test_contrib_flask:by_header")
    client = app.test_client()
    path = PREFIX + f"/runs/{run_id}/approvals/manager"
    as_bob = client.post(path, json={"decision": True, "by": "admin"},
                         headers={"X-User": "bob"})
    assert (as_bob.status_code, as_bob.json["error"]) == (403, "Forbidden")
    assert "you are 'bob'" in as_bob.json["message"]
    bob = client.post(path, json={"decision": True}, headers={"X-User": "bob"})
    assert bob.status_code == 409 and "'bob' is not one of its approvers" in bob.json["message"]
    assert client.post(path, json={"decision": True},
                       headers={"X-User": "nobody-at-all"}).status_code == 401
    admin = client.post(path, json={"decision": True, "by": "admin"},
                        headers={"X-User": "admin"})
    assert admin.status_code == 200 and pikku.get_run(run_id).status == "running"
    with pytest.raises(ImportError, match="PIKKU_IDENTIFY"):
        factory(PikkuFlask(pikku), PIKKU_AUTHORIZE=allow_all, PIKKU_IDENTIFY="tests.nowhere:x")
    with pytest.raises(TypeError, match="PIKKU_IDENTIFY"):
        factory(PikkuFlask(pikku), PIKKU_AUTHORIZE=allow_all, PIKKU_IDENTIFY=42)


def test_identify_returning_anything_but_a_name_is_a_logged_500(
        caplog: pytest.LogCaptureFixture) -> None:
    pikku = make_pikku()
    run_id = pikku.start("gated", None, inline=True)
    app = factory(PikkuFlask(pikku), PIKKU_AUTHORIZE=allow_all, PIKKU_IDENTIFY=by_header)
    with caplog.at_level(logging.ERROR, logger="pikku_celery.contrib"):
        response = app.test_client().post(PREFIX + f"/runs/{run_id}/approvals/manager",
                                          json={"decision": True},
                                          headers={"X-User": "not-a-name"})
    assert (response.status_code, response.json["error"]) == (500, "InternalError")
    assert "PIKKU_IDENTIFY returned a value of type int" in caplog.text
    assert pikku.get_run(run_id).status == "suspended"


def test_flasks_own_body_limit_is_answered_as_json() -> None:
    pikku = make_pikku()
    app = factory(PikkuFlask(pikku), PIKKU_AUTHORIZE=allow_all, MAX_CONTENT_LENGTH=50)
    response = app.test_client().post(PREFIX + "/workflows/sum/runs",
                                      json={"input": {"text": "x" * 100}})
    assert response.status_code == 413 and set(response.json) == {"error", "message"}
    assert pikku.list_runs() == []


def _cross_site_start(app: Flask, origin: str) -> int:
    response = app.test_client().post(
        PREFIX + "/workflows/sum/runs", json={"input": {"a": 1, "b": 1}},
        headers={"Origin": origin, "Sec-Fetch-Site": "cross-site"})
    return response.status_code


def test_trusted_origins_from_the_environment_are_one_string(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``from_prefixed_env()`` keeps a bare value as a string: each origin in it is trusted
    (``tuple(string)`` trusted its characters, so never the origin)."""
    monkeypatch.setenv("FLASK_PIKKU_TRUSTED_ORIGINS", "https://admin.example")
    app = Flask("from-env")
    app.config.from_prefixed_env()
    assert app.config["PIKKU_TRUSTED_ORIGINS"] == "https://admin.example"
    app.config.update(SECRET_KEY="tests", PIKKU_AUTHORIZE=allow_all)
    PikkuFlask(make_pikku()).init_app(app)
    assert _cross_site_start(app, "https://admin.example") == 202
    assert _cross_site_start(app, "https://evil.example") == 403


@pytest.mark.parametrize("setting", [
    "https://a.example, https://b.example",
    "https://a.example https://b.example\n",
    " https://a.example,,https://b.example ",
    ["https://a.example", "https://b.example"],
    ("https://a.example", "https://b.example"),
])
def test_trusted_origins_are_a_list_or_a_string_of_them(setting: Any) -> None:
    app = factory(PikkuFlask(make_pikku()), PIKKU_AUTHORIZE=allow_all,
                  PIKKU_TRUSTED_ORIGINS=setting)
    assert app.extensions["pikku"].trusted_origins == ("https://a.example",
                                                       "https://b.example")
    assert _cross_site_start(app, "https://b.example") == 202
    assert _cross_site_start(app, "h") == 403


@pytest.mark.parametrize("setting", [42, b"https://a.example", ["https://a.example", 7],
                                     {"https://a.example": True}, True])
def test_trusted_origins_of_another_type_are_refused_naming_the_setting(
        setting: Any) -> None:
    with pytest.raises(PikkuConfigurationError, match="PIKKU_TRUSTED_ORIGINS must be"):
        factory(PikkuFlask(make_pikku()), PIKKU_AUTHORIZE=allow_all,
                PIKKU_TRUSTED_ORIGINS=setting)


def test_no_trusted_origins_is_none() -> None:
    app = factory(PikkuFlask(make_pikku()), PIKKU_AUTHORIZE=allow_all,
                  PIKKU_TRUSTED_ORIGINS=None)
    assert app.extensions["pikku"].trusted_origins == ()
    assert _cross_site_start(app, "https://a.example") == 403


# --- commands ----------------------------------------------------------------------------


def test_flask_pikku_lists_and_shows_runs() -> None:
    pikku = make_pikku()
    run_id = pikku.start("sum", {"a": 2, "b": 3}, inline=True)
    app = factory(PikkuFlask(pikku), PIKKU_URL_PREFIX=None)
    runner = app.test_cli_runner()
    listed = runner.invoke(args=["pikku", "runs", "--workflow", "sum"])
    assert listed.exit_code == 0 and run_id in listed.output and "completed" in listed.output
    shown = runner.invoke(args=["pikku", "show", run_id, "--json"])
    assert json.loads(shown.output)["run"]["output"] == 5
    missing = runner.invoke(args=["pikku", "show", "ghost"])
    assert missing.exit_code == 1
    assert missing.output.strip().splitlines() == [
        "Error: WorkflowRunNotFoundError: " + str(_not_found(pikku, "ghost"))]


def _not_found(pikku: PikkuCelery, run_id: str) -> Exception:
    try:
        pikku.get_run(run_id)
    except Exception as exc:
        return exc
    raise AssertionError("found")


class CeleryCLIContext:
    """What Celery's own CLI hands its commands as ``ctx.obj`` (``celery -A proj ...``)."""

    def __init__(self, app: Celery) -> None:
        self.app = app


def test_the_bare_group_acts_on_the_celery_apps_pikku() -> None:
    pikku = make_pikku()
    run_id = pikku.start("sum", {"a": 1, "b": 1}, inline=True)
    result = CliRunner().invoke(pikku_group, ["runs", "--json"],
                                obj=CeleryCLIContext(pikku.app))
    assert [r["run_id"] for r in json.loads(result.output)["runs"]] == [run_id]
    unbound = CliRunner().invoke(pikku_group, ["runs"],
                                 obj=CeleryCLIContext(Celery("no-pikku", set_as_current=False)))
    assert unbound.exit_code == 1 and "no PikkuCelery" in unbound.output
    assert CliRunner().invoke(pikku_group, ["runs"]).exit_code == click.UsageError.exit_code
