"""Events in the ``pikku`` commands (issue 26 item 1): ``pikku send RUN_ID NAME
[PAYLOAD_JSON] [--key K]`` sends one (a payload that is not JSON, an unknown or ended run,
a bad name: one line and exit 1); ``pikku events RUN_ID`` lists a run's events with the wait
that took each (whole values in a pipe, ``--json``); ``show`` prints event waits,
publishes and events and says how to send the event a run waits for; ``resume`` refuses a
run waiting only at an event wait, naming ``pikku send``."""

from __future__ import annotations

import json

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, MongoWorkflowStore, PikkuCelery
from tests.unit.test_cli import mongo_store, one_line_error, run_cli
from tests.unit.test_contrib import make_pikku
from tests.unit.test_contrib_events import with_events
from tests.unit.test_engine import Recorder

__all__ = ["mongo_store"]  # the fixture, on the real MongoDB


@pytest.fixture
def pikku() -> PikkuCelery:
    return with_events(make_pikku())


def lines_starting(output: str, start: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(start)]


def test_send_then_events_and_show(pikku: PikkuCelery) -> None:
    run_id = pikku.start("checkout", None, inline=True, run_id="co-1")
    sent = run_cli(pikku, "send", run_id, "shipped", '{"carrier": "ups"}', "--key", "s-1")
    assert sent.exit_code == 0, sent.output
    assert sent.output == f"sent event 'shipped' to run {run_id} (seq 1, key 's-1')\n"
    assert run_cli(pikku, "send", run_id, "shipped", '"again"', "--key", "s-1").output == \
        sent.output  # the key's first send: nothing more kept
    bare = run_cli(pikku, "send", run_id, "note")  # no payload: null
    assert bare.output == f"sent event 'note' to run {run_id} (seq 2)\n"
    as_json = json.loads(run_cli(pikku, "send", run_id, "paid", "12", "--json").output)
    assert (as_json["name"], as_json["seq"], as_json["payload"]) == ("paid", 3, 12)
    assert [e.payload for e in pikku.list_events(run_id)] == [{"carrier": "ups"}, None, 12]

    waiting = run_cli(pikku, "events", run_id)  # before the wake is served
    assert waiting.exit_code == 0, waiting.output
    assert [line.split()[4:7] for line in lines_starting(waiting.output, "3 ")] == [
        ["-", "not", "taken"]]
    assert "waiting for event 'paid' (times out at " in waiting.output
    assert f"pikku send {run_id} paid [PAYLOAD_JSON] [--key KEY]" in waiting.output

    pikku.engine.advance(run_id)  # the wake the send asked for
    listed = run_cli(pikku, "events", run_id)
    assert listed.output.splitlines()[1].split() == [
        "seq", "event", "sent", "(UTC)", "key", "taken", "by", "payload"]
    rows = [line.split() for line in listed.output.splitlines()[2:]]
    assert [(r[0], r[1], r[4]) for r in rows] == [("1", "shipped", "s-1"), ("2", "note", "-"),
                                                  ("3", "paid", "-")]
    assert rows[0][5:] == ["not", "taken", "yet", '{"carrier":', '"ups"}']
    assert rows[2][5:] == ["event", "paid", "12"]
    data = json.loads(run_cli(pikku, "events", run_id, "--json").output)["events"]
    assert [(e["seq"], e["key"], e["taken_by"], e["taken_by_step"]) for e in data] == [
        (1, "s-1", None, None), (2, None, None, None), (3, None, "event paid", "__event:paid")]
    assert [e["seq"] for e in json.loads(run_cli(pikku, "events", run_id, "--limit", "1",
                                                 "--json").output)["events"]] == [1]

    shown = run_cli(pikku, "show", run_id)
    assert shown.exit_code == 0, shown.output
    assert "__event" not in shown.output and "__publish" not in shown.output
    assert "(sleep)" not in shown.output
    [wait] = [line for line in lines_starting(shown.output, "event paid ")
              if "received" in line]  # the waits table (the attempts table: succeeded)
    assert wait.split()[2] == "received" and wait.split()[-2:] == ["3", "12"]
    assert sorted(line.split()[-1] for line in lines_starting(shown.output, "published ")
                  if line.split()[2] == "published") == ['"paid"', 'payment"']
    assert "events" in [line.strip() for line in shown.output.splitlines()]
    assert "waiting for event" not in shown.output  # it completed
    data = json.loads(run_cli(pikku, "show", run_id, "--json").output)
    assert [(w["name"], w["status"], w["seq"], w["payload"]) for w in data["event_waits"]] \
        == [("paid", "received", 3, 12)]
    assert sorted((p["key"], p["value"]) for p in data["published"]) == [
        ("stage", "paid"), ("stage", "waiting for payment")]
    assert [e["taken_by"] for e in data["events"]] == [None, None, "event paid"]


def test_show_of_a_waiting_run_says_how_to_send(pikku: PikkuCelery) -> None:
    run_id = pikku.start("checkout", None, inline=True)
    shown = run_cli(pikku, "show", run_id).output
    [row] = [line for line in lines_starting(shown, "event paid ") if "-" in line.split()[2:3]]
    assert row.split()[2:4] == ["-", "waiting"]  # the attempts table: no attempt yet
    assert "waiting for event 'paid' (times out at" in shown
    assert f"send it with `pikku send {run_id} paid [PAYLOAD_JSON] [--key KEY]`" in shown
    assert run_cli(pikku, "events", run_id).output.splitlines()[0] == "no events"


def test_send_refusals_are_one_line(pikku: PikkuCelery) -> None:
    run_id = pikku.start("checkout", None, inline=True)
    line = one_line_error(run_cli(pikku, "send", run_id, "paid", "{amount: 12}"))
    assert line.startswith("Error: PAYLOAD_JSON is not JSON: Expecting property name")
    ghost = one_line_error(run_cli(pikku, "send", "ghost", "paid"))
    assert ghost == "Error: WorkflowRunNotFoundError: no workflow run with id 'ghost'"
    bad = one_line_error(run_cli(pikku, "send", run_id, "pa#id", "1"))
    assert "InvalidInputError" in bad and "'#'" in bad
    ended = pikku.start("sum", {"a": 1, "b": 2}, inline=True)
    refused = one_line_error(run_cli(pikku, "send", ended, "paid", "1"))
    assert refused == (f"Error: WorkflowEventError: event 'paid' for run {ended} refused: "
                       "the run has ended (completed)")
    assert one_line_error(run_cli(pikku, "events", "ghost")).startswith(
        "Error: WorkflowRunNotFoundError")
    assert pikku.list_events(run_id) == [] and pikku.list_events(ended) == []


def test_resume_of_a_run_waiting_at_an_event_says_so_and_fails(pikku: PikkuCelery) -> None:
    run_id = pikku.start("checkout", None, inline=True)
    line = one_line_error(run_cli(pikku, "resume", run_id))
    assert line == (f"Error: run {run_id} waits for event 'paid', which resume does not "
                    f"send: send it with `pikku send {run_id} paid [PAYLOAD_JSON] "
                    "[--key KEY]`")
    assert pikku.get_run(run_id).status == "suspended"
    assert pikku.engine.dispatcher.wakes == []  # type: ignore[attr-defined]


def test_piped_events_print_whole_payloads(pikku: PikkuCelery) -> None:
    run_id = pikku.start("checkout", None, inline=True)
    payload = {"note": "x" * 3000}
    assert run_cli(pikku, "send", run_id, "memo", json.dumps(payload)).exit_code == 0
    listed = run_cli(pikku, "events", run_id)  # click's runner: stdout is not a terminal
    [row] = lines_starting(listed.output, "1 ")
    assert row.rstrip().endswith(json.dumps(payload)) and "…" not in row


def test_send_events_and_show_on_a_real_mongodb(mongo_store: MongoWorkflowStore) -> None:
    pikku = with_events(PikkuCelery(Celery("cli-events", set_as_current=False),
                                    store=mongo_store, leases=InMemoryLeaseService(),
                                    worker_reaper=False))
    pikku.engine.dispatcher = Recorder()
    run_id = pikku.start("checkout", None, inline=True, run_id="mongo-co")
    assert run_cli(pikku, "send", run_id, "paid", '{"amount": 5}', "--key", "p").exit_code == 0
    pikku.engine.advance(run_id)
    assert pikku.get_run(run_id).status == "completed"
    data = json.loads(run_cli(pikku, "events", run_id, "--json").output)["events"]
    assert [(e["name"], e["seq"], e["key"], e["taken_by"]) for e in data] == [
        ("paid", 1, "p", "event paid")]
    shown = run_cli(pikku, "show", run_id)
    assert shown.exit_code == 0 and "event paid" in shown.output, shown.output
    refused = one_line_error(run_cli(pikku, "send", run_id, "paid", "1"))
    assert "WorkflowEventError" in refused and "has ended" in refused
