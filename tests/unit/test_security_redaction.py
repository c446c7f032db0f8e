"""Issue 22, item 1: no secret of an error message is stored (the masking in
``pikku_celery.model.redaction`` and the user's ``redact_error`` hook). Each test fails without
the fix."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    MongoWorkflowStore,
    PikkuCelery,
)
from pikku_celery.model.redaction import load_redactor, mask_secrets, redact_error
from tests.conftest import pooled_database

SECRET = "S3cretPw"
LEAKY = f"could not connect to postgres://app:{SECRET}@db.internal/x"


def _pikku(store: Any = None, **options: Any) -> PikkuCelery:
    return PikkuCelery(Celery(f"sec-{uuid.uuid4().hex[:8]}", broker="memory://"),
                       store=store if store is not None else InMemoryWorkflowStore(),
                       leases=InMemoryLeaseService(), worker_reaper=False, **options)


@pytest.fixture
def mongo_store(mongo_server: Any) -> Iterator[MongoWorkflowStore]:
    with pooled_database(mongo_server) as db:
        yield MongoWorkflowStore(db)


def _leaky_app(store: Any, **options: Any) -> PikkuCelery:
    pikku = _pikku(store, **options)

    @pikku.step(name="sec.connect", retries=1, retry_delay=0)
    def connect(data: Any) -> Any:
        raise ConnectionError(LEAKY)

    @pikku.workflow("sec.flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("connect", connect, data)

    return pikku


# --- 1: secrets in error messages ---------------------------------------------------------------


def test_1_no_password_of_a_step_error_is_stored_anywhere_on_mongodb(
        mongo_store: MongoWorkflowStore) -> None:
    pikku = _leaky_app(mongo_store)
    run_id = pikku.start("sec.flow", None, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "failed"
    history = pikku.get_history(run_id)
    assert [a.attempt for a in history] == [1, 2]  # both attempts, each with its error
    assert "postgres://app:***@db.internal/x" in run.error["message"]
    read = json.dumps([run.error, [s.error for s in pikku.get_steps(run_id)],
                       [a.error for a in history]], default=str)
    assert "postgres://app:***@db.internal/x" in read and SECRET not in read
    db = mongo_store.db
    for name in db.list_collection_names():  # runs, steps with their history, any other
        stored = json.dumps(list(db[name].find()), default=str)
        assert SECRET not in stored, name


def test_1_the_users_hook_runs_after_the_masking_and_a_failing_one_loses_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []

    def hook(text: str) -> str:
        seen.append(text)
        return text.replace("db.internal", "<host>")

    pikku = _leaky_app(InMemoryWorkflowStore(), redact_error=hook)
    run = pikku.get_run(pikku.start("sec.flow", None, inline=True))
    assert "postgres://app:***@<host>/x" in run.error["message"]
    assert seen and all(SECRET not in text for text in seen)  # given the masked text

    def broken(text: str) -> str:
        raise RuntimeError(text)

    pikku = _leaky_app(InMemoryWorkflowStore(), redact_error=broken)
    with caplog.at_level(logging.ERROR, logger="pikku_celery.redaction"):
        run = pikku.get_run(pikku.start("sec.flow", None, inline=True))
    assert run.status == "failed" and "postgres://app:***@db.internal/x" in run.error["message"]
    assert "redact_error hook" in caplog.text and SECRET not in caplog.text


def test_1_the_hook_is_a_setting_too_by_dotted_path() -> None:
    app = Celery(f"sec-{uuid.uuid4().hex[:8]}", broker="memory://")
    app.conf.pikku_redact_error = f"{__name__}:shout"
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    assert pikku.settings.redact_error is shout
    with pytest.raises(ValueError, match="redact_error"):
        PikkuCelery(Celery("x", broker="memory://"), redact_error="no.such.module:fn")
    with pytest.raises(ValueError, match="not callable"):
        load_redactor(42, "redact_error")


def shout(text: str) -> str:
    return text.upper()


@pytest.mark.parametrize(("text", "shown"), [
    (LEAKY, "could not connect to postgres://app:***@db.internal/x"),
    ("redis://:pw@h:6379/0 via ssh://git@github.com/x", "redis://:***@h:6379/0 via "
                                                        "ssh://***@github.com/x"),
    ("mongodb://u:p@ss/w@host:1/db", "mongodb://u:***@host:1/db"),  # unescaped '@' and '/'
    ("dsn: host=db password=abc123 user=x", "dsn: host=db password=*** user=x"),
    ('{"Password": "a b", "n": 1}', '{"Password": "***", "n": 1}'),
    ("GET https://h/x?api_key=zzz&b=1", "GET https://h/x?api_key=***&b=1"),
    ("DB_SECRET='s p' client_secret=x, token: y", "DB_SECRET='***' client_secret=***, "
                                                  "token: ***"),
    ("Authorization: Bearer eyJhbGciOi.x.y", "Authorization: Bearer ***"),
    ('headers={"Authorization": "Basic dXNlcjpwdw=="}',
     'headers={"Authorization": "Basic ***"}'),
    ("unexpected token abcdef; Basic validation failed", "unexpected token abcdef; Basic "
                                                         "validation failed"),
    ("nothing secret here: a=1, https://example.com/a", "nothing secret here: a=1, "
                                                        "https://example.com/a"),
])
def test_1_masking(text: str, shown: str) -> None:
    assert mask_secrets(text) == shown
    assert mask_secrets(shown) == shown  # idempotent


def test_1_an_error_dict_keeps_its_other_fields() -> None:
    error = {"type": "ConnectionError", "message": LEAKY, "traceback": f"... {LEAKY}\n",
             "attempt": 2}
    masked = redact_error(error)
    assert masked["type"] == "ConnectionError" and masked["attempt"] == 2
    assert SECRET not in masked["message"] + masked["traceback"]


_USERINFO = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E,
                                  exclude_characters="@:/?#'\"<>"), min_size=1, max_size=30)


@settings(max_examples=300, deadline=None)
@given(user=_USERINFO.filter(lambda u: ":" not in u),
       password=st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Z", "Cc"),
                                      exclude_characters="@'\"<>"), min_size=4, max_size=40),
       scheme=st.sampled_from(["postgres", "mongodb+srv", "redis", "amqp", "https"]),
       before=st.sampled_from(["", "could not connect to ", "error (", "url="]),
       after=st.sampled_from(["", "/x", ":5432/db?sslmode=require", ") refused"]))
@example(user="u", password="refused", scheme="postgres", before="",
         after=") refused")  # a password that is also a word of the text around it
def test_1_the_password_of_a_url_never_survives(user: str, password: str, scheme: str,
                                                before: str, after: str) -> None:
    text = f"{before}{scheme}://{user}:{password}@db.internal{after}"
    # The whole text is compared, not "the password is absent": a drawn password may be a
    # word of the text around it ("refused"), which the masking rightly keeps.
    assert mask_secrets(text) == f"{before}{scheme}://{user}:***@db.internal{after}"


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["password", "PASSWORD", "db_password", "api_key", "apikey",
                             "token", "access_token", "client_secret", "pwd"]),
       value=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E,
                                   exclude_characters="&,;'\")}]"), min_size=6, max_size=30),
       sep=st.sampled_from(["=", ": ", " = "]))
@example(name="password", value="failed", sep="=")  # also a word of the text around it
@example(name="db_password", value="password", sep=": ")  # a part of the secret's name
def test_1_a_secret_pair_never_survives(name: str, value: str, sep: str) -> None:
    # As above: exactly the value is masked, whatever else of the text it also spells.
    assert mask_secrets(f"failed with {name}{sep}{value} and more") == (
        f"failed with {name}{sep}*** and more")
