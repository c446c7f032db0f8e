"""Sending an event to a waiting run from the dashboard in a real headless Chromium (issue
26 item 1): the run page shows the event wait as a gate and a Send event form filled with
the event's name; a payload that is not JSON is refused with the reason and the text as
typed; a send it takes wakes the run, which takes the event and completes, and the page
lists the event as taken by its wait. Same setup as ``test_dashboard_browser.py`` (Flask,
``PikkuFlask``, Werkzeug on a loopback port, in-memory services, Debian's chromium), with
the test kit's inline engine, so the wake a send asks for runs the run at once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec

from pikku_celery import PikkuCelery
from pikku_celery.testing import inline
from tests.integration.test_dashboard_browser import wait
from tests.support.browser import chromium, served_dashboard
from tests.unit.test_contrib import authorize, identify, make_pikku
from tests.unit.test_contrib_events import with_events

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pikku() -> Iterator[PikkuCelery]:
    pikku = with_events(make_pikku())
    with inline(pikku, hold_timers=True):  # the send's wake runs the run, in the request
        yield pikku


@pytest.fixture(scope="module")
def base_url(pikku: PikkuCelery) -> Iterator[str]:
    with served_dashboard(pikku, "dashboard-events-browser", PIKKU_AUTHORIZE=authorize,
                          PIKKU_IDENTIFY=identify) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def test_an_event_sent_through_the_form_completes_the_run(pikku: PikkuCelery, browser: Any,
                                                          base_url: str) -> None:
    run_id = pikku.start("checkout", None, run_id="browser-checkout")
    assert pikku.get_run(run_id).status == "suspended"
    browser.delete_all_cookies()
    browser.get(f"{base_url}/login/admin")
    browser.get(f"{base_url}/pikku/runs/{run_id}")
    name = wait(browser).until(ec.presence_of_element_located((By.ID, "event-name")))
    assert name.get_attribute("value") == "paid"  # the event the run waits for
    labels = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "text.step-label")]
    assert "event paid" in labels and not any("sleep" in label for label in labels)
    assert browser.find_elements(By.CSS_SELECTOR, "rect.gap-event")
    assert not browser.find_elements(By.ID, "resume")  # it would change nothing

    payload = browser.find_element(By.ID, "event-payload")
    payload.send_keys("{amount: 12}")
    browser.find_element(By.ID, "send-event-button").click()
    refused = wait(browser).until(ec.presence_of_element_located((By.ID, "event-refused")))
    assert "the payload is not JSON" in refused.text
    kept = browser.find_element(By.ID, "event-payload")
    assert kept.get_attribute("value") == "{amount: 12}"
    assert pikku.list_events(run_id) == []

    kept.clear()
    kept.send_keys('{"amount": 12}')
    browser.find_element(By.ID, "event-key").send_keys("pay-1")
    browser.find_element(By.ID, "send-event-button").click()
    notice = wait(browser).until(ec.presence_of_element_located((By.ID, "notice")))
    assert notice.text == "event sent"
    assert browser.find_element(By.ID, "run-status").text == "completed"
    [row] = browser.find_elements(By.CSS_SELECTOR, "#events tbody tr")
    assert row.get_attribute("data-event") == "paid"
    assert row.get_attribute("data-taken") == "__event:paid"
    assert "event paid" in row.text and "pay-1" in row.text
    assert not browser.find_elements(By.ID, "send-event-form")  # the run has ended
    assert pikku.get_run(run_id).output == {"paid": {"amount": 12}}
