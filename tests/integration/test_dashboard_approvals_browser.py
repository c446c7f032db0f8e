"""Deciding an approval gate on the dashboard in a real headless Chromium (issue 25 item
3): the run page shows the gate (name, approvers, schema), offers no Resume, and records
the decision its Approve button gives, as the signed-in user (the forms of other schemas,
a refusal and the page's refresh: ``test_dashboard_decision_browser.py``).
Same setup as ``test_dashboard_browser.py`` (Flask, ``PikkuFlask``, Werkzeug on a
loopback port, in-memory services, Debian's chromium), with ``PIKKU_IDENTIFY`` naming the
signed-in user."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec

from pikku_celery import PikkuCelery
from tests.integration.test_dashboard_browser import wait
from tests.support.browser import chromium, served_dashboard
from tests.unit.test_contrib import authorize, identify, make_pikku

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pikku() -> PikkuCelery:
    return make_pikku()


@pytest.fixture(scope="module")
def base_url(pikku: PikkuCelery) -> Iterator[str]:
    with served_dashboard(pikku, "dashboard-approvals-browser", PIKKU_AUTHORIZE=authorize,
                                  PIKKU_IDENTIFY=identify) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def test_an_approval_is_decided_through_its_form(pikku: PikkuCelery, browser: Any,
                                                 base_url: str) -> None:
    run_id = pikku.start("gated", None, inline=True)
    browser.delete_all_cookies()
    browser.get(f"{base_url}/login/admin")
    browser.get(f"{base_url}/pikku/runs/{run_id}")
    gate = wait(browser).until(ec.presence_of_element_located(
        (By.CSS_SELECTOR, '#approvals .gate[data-gate="manager"]')))
    assert gate.get_attribute("data-status") == "waiting"
    assert gate.find_element(By.CSS_SELECTOR, ".gate-approvers").text == "admin"
    assert '"type": "boolean"' in gate.find_element(By.CSS_SELECTOR, ".gate-schema").text
    labels = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "text.step-label")]
    assert labels == ["manager approval"]  # the gate's name and its kind, not "sleep"
    assert not browser.find_elements(By.ID, "resume")  # it would change nothing

    # A yes/no schema is two buttons, no JSON to type (test_dashboard_decision_browser.py:
    # every kind of field, a refusal, what survives the page's refresh).
    assert not gate.find_elements(By.CSS_SELECTOR, 'textarea[name="decision"]')
    gate.find_element(By.CSS_SELECTOR, 'button[name="verdict"][value="true"]').click()
    notice = wait(browser).until(ec.presence_of_element_located((By.ID, "notice")))
    assert notice.text == "decision recorded"
    decided = browser.find_element(By.CSS_SELECTOR, '.gate[data-gate="manager"]')
    assert decided.get_attribute("data-status") == "decided"
    assert "by admin" in decided.text
    assert not browser.find_elements(By.CSS_SELECTOR, 'button[name="verdict"]')
    assert pikku.get_run(run_id).status == "running"
    [gate_step] = pikku.get_steps(run_id)
    assert gate_step.result is True
