"""Deciding approvals through the form a gate's schema makes, in a real headless Chromium
(issue 36 item 2): a yes/no gate is Approve / Reject buttons (Enter in its comment field
decides nothing; Reject records ``false``), an enum is a choice and an integer a number
field the browser checks against the schema's bounds, what the browser cannot check is
refused by the server with the fields kept as typed, and a field being typed survives the
page's refresh. Same setup as ``test_dashboard_approvals_browser.py`` (Flask,
``PikkuFlask``, Werkzeug on a loopback port, in-memory services, Debian's chromium)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import Select

from pikku_celery import PikkuCelery, WorkflowContext
from tests.integration.test_dashboard_browser import wait
from tests.support.browser import chromium, gone, served_dashboard
from tests.unit.test_contrib import authorize, identify, make_pikku

pytestmark = pytest.mark.slow

SIGNOFF = {"type": "object", "required": ["approved"],
           "properties": {"approved": {"type": "boolean"},
                          "comment": {"type": "string", "maxLength": 40}}}
DISPATCH = {"type": "object", "required": ["team", "count"],
            "properties": {"team": {"enum": ["ops", "dev"]},
                           "count": {"type": "integer", "minimum": 1, "maximum": 5},
                           "code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}


@pytest.fixture(scope="module")
def pikku() -> PikkuCelery:
    pikku = make_pikku()

    @pikku.workflow("signoff")
    def signoff(wf: WorkflowContext, data: Any) -> Any:
        return wf.approval("signoff", schema=SIGNOFF, approvers=["admin"])

    @pikku.workflow("dispatch")
    def dispatch(wf: WorkflowContext, data: Any) -> Any:
        return wf.approval("dispatch", schema=DISPATCH)

    return pikku


@pytest.fixture(scope="module")
def base_url(pikku: PikkuCelery) -> Iterator[str]:
    with served_dashboard(pikku, "dashboard-decision-browser", PIKKU_AUTHORIZE=authorize,
                          PIKKU_IDENTIFY=identify) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def open_gate(browser: Any, base_url: str, run_id: str, name: str) -> Any:
    browser.delete_all_cookies()
    browser.get(f"{base_url}/login/admin")
    browser.get(f"{base_url}/pikku/runs/{run_id}")
    return wait(browser).until(ec.presence_of_element_located(
        (By.CSS_SELECTOR, f'#approvals .gate[data-gate="{name}"]')))


def field(gate: Any, name: str) -> Any:
    return gate.find_element(By.CSS_SELECTOR, f'label[data-field="{name}"] input, '
                                              f'label[data-field="{name}"] select')


def test_a_yes_no_gate_is_approve_or_reject(pikku: PikkuCelery, browser: Any,
                                            base_url: str) -> None:
    run_id = pikku.start("signoff", None, inline=True)
    gate = open_gate(browser, base_url, run_id, "signoff")
    assert not gate.find_elements(By.TAG_NAME, "textarea")  # nothing to type as JSON
    approve = gate.find_element(By.CSS_SELECTOR, 'button[name="verdict"][value="true"]')
    reject = gate.find_element(By.CSS_SELECTOR, 'button[name="verdict"][value="false"]')
    assert (approve.text, reject.text) == ("Approve", "Reject")
    assert approve.is_displayed() and reject.is_displayed()

    comment = field(gate, "comment")
    comment.send_keys("needs a second look")
    # The live page re-reads itself every few seconds: a comment being typed survives.
    wait(browser).until(gone(browser.find_element(By.ID, "live")))
    assert comment.get_attribute("value") == "needs a second look"
    comment.send_keys(Keys.ENTER)  # decides nothing: only a button does
    time.sleep(1.0)
    assert not browser.find_elements(By.ID, "notice")
    assert pikku.get_run(run_id).status == "suspended"

    reject.click()
    notice = wait(browser).until(ec.presence_of_element_located((By.ID, "notice")))
    assert notice.text == "decision recorded"
    decided = browser.find_element(By.CSS_SELECTOR, '.gate[data-gate="signoff"]')
    assert decided.get_attribute("data-status") == "decided"
    assert "by admin" in decided.text and '"approved": false' in decided.text
    assert not decided.find_elements(By.CSS_SELECTOR, 'button[name="verdict"]')
    [gate_step] = pikku.get_steps(run_id)
    assert gate_step.result == {"approved": False, "comment": "needs a second look"}


def test_choices_and_numbers_are_checked_by_the_browser_then_the_server(
        pikku: PikkuCelery, browser: Any, base_url: str) -> None:
    run_id = pikku.start("dispatch", None, inline=True)
    gate = open_gate(browser, base_url, run_id, "dispatch")
    team = Select(field(gate, "team"))
    assert [o.text for o in team.options] == ["choose one", "ops", "dev"]
    count = field(gate, "count")
    assert (count.get_attribute("type"), count.get_attribute("min"),
            count.get_attribute("max")) == ("number", "1", "5")
    submit = gate.find_element(By.CSS_SELECTOR, 'button[type="submit"]')
    assert submit.text == "Record decision"

    # Required and out of bounds: the browser itself refuses to send the form.
    count.send_keys("9")
    submit.click()
    time.sleep(0.5)
    assert browser.execute_script("return arguments[0].validity.valid", count) is False
    assert browser.execute_script(
        "return arguments[0].validity.valueMissing", field(gate, "team")) is True
    assert not browser.find_elements(By.ID, "decision-refused")

    # The pattern is the server's to check (the form does not copy it): refused, and
    # every field comes back as typed.
    team.select_by_visible_text("dev")
    count.clear()
    count.send_keys("3")
    field(gate, "code").send_keys("abc")
    submit.click()
    refused = wait(browser).until(ec.presence_of_element_located((By.ID, "decision-refused")))
    assert "does not match its schema" in refused.text and "code" in refused.text
    gate = browser.find_element(By.CSS_SELECTOR, '.gate[data-gate="dispatch"]')
    assert Select(field(gate, "team")).first_selected_option.text == "dev"
    assert field(gate, "count").get_attribute("value") == "3"
    code = field(gate, "code")
    assert code.get_attribute("value") == "abc"
    assert pikku.get_run(run_id).status == "suspended"

    code.clear()
    code.send_keys("ABC")
    gate.find_element(By.CSS_SELECTOR, 'button[type="submit"]').click()
    notice = wait(browser).until(ec.presence_of_element_located((By.ID, "notice")))
    assert notice.text == "decision recorded"
    [gate_step] = pikku.get_steps(run_id)
    assert gate_step.result == {"team": "dev", "count": 3, "code": "ABC"}
