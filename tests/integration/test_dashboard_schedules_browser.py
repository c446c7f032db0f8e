"""Schedules on the dashboard in a real headless Chromium (issue 26 item 2): from the runs
page's header to the Schedules page; Pause marks the schedule paused and offers Resume;
a stale Pause (the page from before) is refused with the reason; Resume makes it active
again; Trigger starts a run at once, opens its page, which names the schedule and its
tick, and the Schedules page lists no new tick for it (a trigger is outside the ticks).
Same setup as ``test_dashboard_events_browser.py`` (Flask, ``PikkuFlask``, Werkzeug on a
loopback port, in-memory services, Debian's chromium) with the test kit's inline engine,
so the triggered run completes in the request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec

from pikku_celery import PikkuCelery
from pikku_celery.testing import inline
from tests.integration.test_dashboard_browser import wait
from tests.support.browser import chromium, gone, served_dashboard
from tests.unit.test_contrib import authorize, make_pikku, with_schedule

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pikku() -> Iterator[PikkuCelery]:
    pikku = with_schedule(make_pikku())
    with inline(pikku, hold_timers=True):  # saves the schedule; a trigger runs its run
        yield pikku


@pytest.fixture(scope="module")
def base_url(pikku: PikkuCelery) -> Iterator[str]:
    with served_dashboard(pikku, "dashboard-schedules-browser",
                          PIKKU_AUTHORIZE=authorize) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def click(browser: Any, element_id: str) -> None:
    """Click a form's button and wait for the page it loads (not the one still shown).

    Chromium can still be swapping in the page the last submit loaded when the button is
    looked up, and the click then lands on a node of the page it left ("Node with given
    id does not belong to the document", seen once in CI): nothing was clicked, so the
    lookup is made again on the page now shown."""
    for tries_left in (2, 1, 0):
        page = browser.find_element(By.TAG_NAME, "html")
        try:
            wait(browser).until(ec.element_to_be_clickable((By.ID, element_id))).click()
        except (StaleElementReferenceException, WebDriverException) as exc:
            detached = (isinstance(exc, StaleElementReferenceException)
                        or "does not belong to the document" in str(exc))
            if not detached or not tries_left:
                raise
            continue
        wait(browser).until(gone(page))
        return


def state(browser: Any) -> str:
    return str(browser.find_element(By.ID, "schedule-nightly").get_attribute("data-paused"))


def test_pause_resume_and_trigger_a_schedule(pikku: PikkuCelery, browser: Any,
                                             base_url: str) -> None:
    browser.delete_all_cookies()
    browser.get(f"{base_url}/login/admin")
    browser.get(f"{base_url}/pikku/")
    wait(browser).until(ec.element_to_be_clickable((By.ID, "nav-schedules"))).click()
    wait(browser).until(ec.presence_of_element_located((By.ID, "schedule-nightly")))
    row = browser.find_element(By.ID, "schedule-nightly")
    assert "every 1h" in row.text and "active" in row.text

    click(browser, "pause-nightly")
    notice = wait(browser).until(ec.presence_of_element_located((By.ID, "notice")))
    assert notice.text.startswith("schedule paused")
    assert state(browser) == "true" and pikku.get_schedule("nightly").paused
    assert not browser.find_elements(By.ID, "pause-nightly")

    # A Pause sent as from a page loaded before the pause (its form turned back into a
    # pause): refused, with the reason.
    page = browser.find_element(By.TAG_NAME, "html")
    browser.execute_script(
        "const f = document.querySelector('form.schedule-resume');"
        "f.action = f.action.replace(/resume$/, 'pause'); f.submit();")
    wait(browser).until(gone(page))
    refused = wait(browser).until(ec.presence_of_element_located((By.ID, "schedule-refused")))
    assert "already paused: nothing to pause" in refused.text
    assert state(browser) == "true"

    click(browser, "resume-nightly")
    notice = wait(browser).until(ec.presence_of_element_located((By.ID, "notice")))
    assert notice.text.startswith("schedule resumed")
    assert state(browser) == "false" and not pikku.get_schedule("nightly").paused

    click(browser, "trigger-nightly")
    notice = wait(browser).until(ec.presence_of_element_located((By.ID, "notice")))
    assert notice.text.startswith("run started: its schedule was triggered")
    [run] = pikku.list_runs()
    assert (run.schedule, run.status, run.output) == ("nightly", "completed", 3)
    assert browser.find_element(By.ID, "run-status").text == "completed"
    assert browser.find_element(By.ID, "run-schedule").text == "nightly"
    assert browser.find_element(By.ID, "run-scheduled-for").text.startswith("20")
    click(browser, "run-schedule")
    wait(browser).until(ec.presence_of_element_located((By.ID, "schedule-nightly")))
    assert state(browser) == "false"
