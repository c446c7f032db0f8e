"""Transactional steps on the real ``mongod`` (issue 26, item 4), run by the inline engine,
in the fast tier (issue 31: they were only in tests/integration, which ``./dev mutate``
does not run, and the mutants of the transaction's fences survived).

What each test holds to: the body's writes with ``ctx.session`` commit with the step's
settle, and only then; a body that fails leaves no write, and its retry's writes stand; an
attempt superseded or cancelled, while its body runs or before its transaction even
started, leaves none of its writes; a transient transaction error runs the body again in
the same attempt; a commit that fails leaves no recorded success either (the settle is the
transaction's, not written beside it); and a commit whose outcome stays unknown counts as
a success only when the step, read back, holds this attempt's own settle.

The in-memory store has no transactions (``tests/unit/test_transactional_kit.py``: the body
runs with no session), so these run on ``mongod`` only: the session's single-node replica
set. A standalone server's refusal and the docs example stay in
``tests/integration/test_transactional_steps.py`` (a server of their own, and Redis)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from pymongo.client_session import ClientSession
from pymongo.errors import OperationFailure

from pikku_celery import (
    InMemoryLeaseService,
    InvalidInputError,
    MongoWorkflowStore,
    PikkuCelery,
    WorkflowStepSupersededError,
)
from pikku_celery.worker.inline import run_inline
from tests.conftest import pooled_database

STEP = "txn.place"


def _in_another_thread(work: Callable[[], object]) -> None:
    """``work`` from another thread, as another process's write would come: outside the
    body's transaction and the store's session of this thread."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # re-raised here, in the test's thread
            failed.append(exc)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and not failed, failed


class Shop:
    """A PikkuCelery on the session's ``mongod``, with one transactional step whose body
    the test steers: ``during(ctx)`` runs inside the transaction after the body's write,
    ``before(run_id)`` just before the transaction starts, and ``result(ctx, data)`` is
    what the body returns (the placed order and its attempt unless a test says)."""

    def __init__(self, db: Any, *, lease: str | None = None) -> None:
        self.store = MongoWorkflowStore(db)
        self.orders = db["orders"]
        self.pikku = PikkuCelery(Celery(f"txn-{uuid.uuid4().hex[:8]}", broker="memory://"),
                                 store=self.store, leases=InMemoryLeaseService(),
                                 worker_reaper=False)
        self.during: Callable[[Any], None] | None = None
        self.before: Callable[[str], None] | None = None
        self.result: Callable[[Any, Any], Any] = lambda ctx, data: {
            "placed": data["order"], "attempt": ctx.attempt}
        shop, name = self, db.name
        opens = self.store.step_transaction

        def step_transaction(step_name: str) -> Any:
            if shop.before is not None and shop.running is not None:
                shop.before(shop.running)
            return opens(step_name)
        self.store.step_transaction = step_transaction  # type: ignore[method-assign]
        self.running: str | None = None

        @self.pikku.step(name=STEP, bind=True, transactional=True, retries=2,
                         retry_delay="10ms", lease=lease)
        def place(ctx: Any, data: Any) -> Any:
            orders = ctx.session.client[name]["orders"]
            orders.insert_one({"order": data["order"], "attempt": ctx.attempt},
                              session=ctx.session)
            if shop.during is not None:
                shop.during(ctx)
            return shop.result(ctx, data)

        @self.pikku.workflow("txn_order")
        def order(wf: Any, data: Any) -> Any:
            return wf.do("place", place, data)

    def written(self) -> list[tuple[str, int]]:
        return sorted((d["order"], d["attempt"]) for d in self.orders.find({}))

    def start(self, order: str) -> str:
        self.running = self.pikku.start("txn_order", {"order": order})
        return self.running

    def step(self, run_id: str) -> tuple[str, int]:
        state = self.store.get_step(run_id, "place")
        assert state is not None
        return state.status, state.attempt

    def reclaim(self, run_id: str) -> int:
        """Another worker's reclaim of the step, its lease taken for lapsed."""
        later = self.pikku.engine.now_ms() + 10 * 60_000
        claimed = self.store.claim_step(run_id, "place", STEP, later, 60_000).state
        assert claimed is not None
        return claimed.attempt


@pytest.fixture
def shop(mongo_server: Any) -> Iterator[Shop]:
    with pooled_database(mongo_server) as db:
        yield Shop(db)


# --- the body's writes commit with the settle, or not at all ------------------------------


def test_the_bodys_writes_commit_with_the_settle(shop: Shop) -> None:
    run = run_inline(shop.pikku.engine, shop.start("o-1"))
    assert run.status == "completed" and run.output == {"placed": "o-1", "attempt": 1}
    assert shop.written() == [("o-1", 1)]


def test_a_failed_body_leaves_no_write_and_its_retry_commits(shop: Shop) -> None:
    def fail_first(ctx: Any) -> None:
        if ctx.attempt == 1:
            raise ConnectionError("the card service is down")
    shop.during = fail_first
    run = run_inline(shop.pikku.engine, shop.start("o-2"))
    assert run.status == "completed", run
    assert shop.written() == [("o-2", 2)]  # attempt 1's insert rolled back
    statuses = [(a.attempt, a.status) for a in shop.pikku.get_history(run.run_id)]
    assert statuses == [(1, "failed"), (2, "succeeded")]


def test_an_attempt_superseded_while_its_body_runs_leaves_no_write(shop: Shop) -> None:
    seen: list[int] = []

    def reclaimed_meanwhile(ctx: Any) -> None:
        if ctx.attempt == 1:
            _in_another_thread(lambda: seen.append(shop.reclaim(ctx.run_id)))
    shop.during = reclaimed_meanwhile
    run_id = shop.start("o-3")
    with pytest.raises(WorkflowStepSupersededError, match=r"superseded by attempt 2"):
        run_inline(shop.pikku.engine, run_id)
    assert seen == [2]
    assert shop.written() == []  # attempt 1's insert rolled back; attempt 2 has not run
    assert shop.step(run_id) == ("running", 2)


def test_an_attempt_cancelled_while_its_body_runs_leaves_no_write(shop: Shop) -> None:
    shop.during = lambda ctx: _in_another_thread(lambda: shop.pikku.cancel(ctx.run_id, "no"))
    run_id = shop.start("o-4")
    with pytest.raises(WorkflowStepSupersededError, match=r"attempt 1 was fenced"):
        run_inline(shop.pikku.engine, run_id)
    assert shop.written() == []
    assert shop.pikku.get_run(run_id).status == "cancelled"


def test_an_attempt_superseded_before_its_transaction_starts_leaves_no_write(
        shop: Shop) -> None:
    """The reclaim lands between the attempt's claim and its transaction: the body runs
    on a snapshot that already shows attempt 2, so its settle matches nothing (no write
    conflict), and the transaction must still be rolled back, not committed."""
    seen: list[int] = []
    shop.before = lambda run_id: _in_another_thread(lambda: seen.append(shop.reclaim(run_id)))
    run_id = shop.start("o-5")
    with pytest.raises(WorkflowStepSupersededError, match=r"superseded by attempt 2"):
        run_inline(shop.pikku.engine, run_id)
    assert seen == [2]
    assert shop.written() == []
    assert shop.step(run_id) == ("running", 2)


def test_an_attempt_cancelled_before_its_transaction_starts_leaves_no_write(
        shop: Shop) -> None:
    shop.before = lambda run_id: _in_another_thread(lambda: shop.pikku.cancel(run_id, "no"))
    run_id = shop.start("o-6")
    with pytest.raises(WorkflowStepSupersededError, match=r"attempt 1 was fenced"):
        run_inline(shop.pikku.engine, run_id)
    assert shop.written() == []
    assert shop.pikku.get_run(run_id).status == "cancelled"
    assert shop.step(run_id) == ("failed", 1)


def test_a_transient_transaction_error_runs_the_body_again(shop: Shop) -> None:
    tries: list[int] = []

    def conflict_once(ctx: Any) -> None:
        tries.append(ctx.attempt)
        if len(tries) == 1:
            raise OperationFailure("WriteConflict", code=112,
                                   details={"errorLabels": ["TransientTransactionError"],
                                            "code": 112, "errmsg": "WriteConflict"})
    shop.during = conflict_once
    run = run_inline(shop.pikku.engine, shop.start("o-7"))
    assert run.status == "completed", run
    assert tries == [1, 1]  # the same attempt, twice: no attempt spent on a conflict
    assert shop.written() == [("o-7", 1)]


def test_transactional_needs_bind() -> None:
    pikku = PikkuCelery(Celery(f"txn-{uuid.uuid4().hex[:8]}", broker="memory://"))
    with pytest.raises(InvalidInputError, match="transactional=True needs bind=True"):
        @pikku.step(name="txn.unbound", transactional=True)
        def unbound(data: Any) -> None:
            return None


# --- the commit: failed, or its outcome unknown ----------------------------------------


def _commit_fails(monkeypatch: pytest.MonkeyPatch, *, label: str | None,
                  lands: bool = False, then: Callable[[], None] | None = None) -> None:
    """Every commit of a transaction raises (with ``label``, if given), as when the server's
    answer is lost. The first commit is really made first when ``lands``, else the
    transaction is really aborted; ``then`` runs after that first one."""
    commits: list[int] = []
    real = ClientSession.commit_transaction

    def commit_transaction(session: ClientSession) -> None:
        commits.append(1)
        if len(commits) == 1:
            if lands:
                real(session)
            else:
                session.abort_transaction()
            if then is not None:
                then()
        raise OperationFailure("commit: no answer", code=50,
                               details={"errorLabels": [label] if label else [],
                                        "code": 50, "errmsg": "commit: no answer"})
    monkeypatch.setattr(ClientSession, "commit_transaction", commit_transaction)


def test_a_failed_commit_leaves_no_recorded_success(
        shop: Shop, monkeypatch: pytest.MonkeyPatch) -> None:
    """The settle is written in the transaction: a commit that fails takes it back with
    the body's writes, and the step is left running for its lease to lapse (no success is
    recorded without the writes it stands for)."""
    _commit_fails(monkeypatch, label=None)
    run_id = shop.start("o-8")
    with pytest.raises(OperationFailure, match="commit: no answer"):
        run_inline(shop.pikku.engine, run_id)
    assert shop.written() == []
    assert shop.step(run_id) == ("running", 1)
    assert [(a.attempt, a.status) for a in shop.pikku.get_history(run_id)] == [
        (1, "running")]


@pytest.fixture
def quick_shop(mongo_server: Any) -> Iterator[Shop]:
    """A shop whose step's lease is short: a commit whose outcome stays unknown is asked
    again for one lease from the attempt's start, then read back."""
    with pooled_database(mongo_server) as db:
        yield Shop(db, lease="500ms")


def test_an_unknown_commit_that_landed_is_read_back_as_the_settle(
        quick_shop: Shop, monkeypatch: pytest.MonkeyPatch) -> None:
    _commit_fails(monkeypatch, label="UnknownTransactionCommitResult", lands=True)
    run = run_inline(quick_shop.pikku.engine, quick_shop.start("o-9"))
    assert run.status == "completed" and run.output == {"placed": "o-9", "attempt": 1}
    assert quick_shop.written() == [("o-9", 1)]
    assert quick_shop.step(run.run_id) == ("succeeded", 1)


def test_an_unknown_commit_that_did_not_land_is_no_settle(
        quick_shop: Shop, monkeypatch: pytest.MonkeyPatch) -> None:
    _commit_fails(monkeypatch, label="UnknownTransactionCommitResult")
    run_id = quick_shop.start("o-10")
    with pytest.raises(OperationFailure, match="commit: no answer"):
        run_inline(quick_shop.pikku.engine, run_id)
    assert quick_shop.written() == []
    assert quick_shop.step(run_id) == ("running", 1)  # its lease lapses: claimed again


def test_an_unknown_commit_never_takes_a_newer_attempts_settle_for_its_own(
        quick_shop: Shop, monkeypatch: pytest.MonkeyPatch) -> None:
    """While attempt 1's commit is unknown (and did not land), attempt 2 reclaims the step
    and settles it with the same result: the read-back must not report it as attempt 1's."""
    quick_shop.result = lambda ctx, data: "placed"
    holder: list[str] = []

    def newer_attempt_settles() -> None:
        def reclaim_and_settle() -> None:
            run_id = holder[0]
            attempt = quick_shop.reclaim(run_id)
            quick_shop.store.set_result(run_id, "place", attempt, "placed",
                                        quick_shop.pikku.engine.now_ms())
        _in_another_thread(reclaim_and_settle)
    _commit_fails(monkeypatch, label="UnknownTransactionCommitResult",
                  then=newer_attempt_settles)
    holder.append(quick_shop.start("o-11"))
    with pytest.raises(OperationFailure, match="commit: no answer"):
        run_inline(quick_shop.pikku.engine, holder[0])
    assert quick_shop.step(holder[0]) == ("succeeded", 2)
    assert quick_shop.written() == []  # attempt 1's writes rolled back; 2 wrote none here


def test_an_unknown_commit_never_takes_a_cancels_fence_for_its_settle(
        quick_shop: Shop, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same, with a cancel fencing attempt 1 meanwhile: the step holds attempt 1 and the
    body's result (``None``) beside a failed status, which is not a settle."""
    quick_shop.result = lambda ctx, data: None
    holder: list[str] = []
    _commit_fails(monkeypatch, label="UnknownTransactionCommitResult",
                  then=lambda: _in_another_thread(
                      lambda: quick_shop.pikku.cancel(holder[0], "no")))
    holder.append(quick_shop.start("o-12"))
    with pytest.raises(OperationFailure, match="commit: no answer"):
        run_inline(quick_shop.pikku.engine, holder[0])
    assert quick_shop.step(holder[0]) == ("failed", 1)
    assert quick_shop.pikku.get_run(holder[0]).status == "cancelled"
    assert quick_shop.written() == []
