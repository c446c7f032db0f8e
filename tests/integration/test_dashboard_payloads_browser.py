"""An event's payload on the dashboard's run page in a real headless Chromium (issue 35,
item 3): the page carries no payload; opening an event's row reads its payload from the
JSON API once, and the live page's refresh, which swaps in the page read again, keeps the
payload read and never reads it again (an event's payload never changes), while it does
show the events sent since. Same setup as ``test_dashboard_events_browser.py``, the
refresh every second instead of five."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec

from pikku_celery import PikkuCelery
from pikku_celery.dashboard import _pages
from pikku_celery.testing import inline
from tests.integration.test_dashboard_browser import wait
from tests.support.browser import chromium, served_dashboard
from tests.unit.test_contrib import authorize, identify, make_pikku
from tests.unit.test_contrib_events import with_events

pytestmark = pytest.mark.slow
PAYLOAD_READS = """var url = arguments[0]; return performance.getEntriesByType("resource")
    .filter(function (e) { return e.name.indexOf(url) >= 0; }).length;"""


@pytest.fixture(scope="module")
def pikku() -> Iterator[PikkuCelery]:
    pikku = with_events(make_pikku())
    with inline(pikku, hold_timers=True):
        yield pikku


@pytest.fixture(scope="module")
def base_url(pikku: PikkuCelery) -> Iterator[str]:
    with served_dashboard(pikku, "dashboard-payloads-browser", PIKKU_AUTHORIZE=authorize,
                          PIKKU_IDENTIFY=identify) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def test_a_payload_is_read_once_when_opened_and_kept_across_refreshes(
        pikku: PikkuCelery, browser: Any, base_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pages, "REFRESH_S", 1)
    run_id = pikku.start("checkout", None, run_id="browser-payloads")
    pikku.send_event(run_id, "note", {"card": "SECRET-1"})
    browser.delete_all_cookies()
    browser.get(f"{base_url}/login/admin")
    browser.get(f"{base_url}/pikku/runs/{run_id}")
    box = wait(browser).until(ec.presence_of_element_located((By.ID, "event-payload-1")))
    assert "SECRET-1" not in browser.page_source
    box.find_element(By.TAG_NAME, "summary").click()
    wait(browser).until(lambda b: "SECRET-1" in b.find_element(
        By.CSS_SELECTOR, "#event-payload-1 pre.event-payload").text)
    url = f"/api/runs/{run_id}/events/1/payload"
    assert browser.execute_script(PAYLOAD_READS, url) == 1
    # A second event: the refresh shows its row, keeps the first payload open and read.
    pikku.send_event(run_id, "note", {"card": "SECRET-2"})
    wait(browser).until(ec.presence_of_element_located((By.ID, "event-payload-2")))
    browser.execute_script('document.getElementById("live").setAttribute("data-seen", "1")')
    wait(browser).until(lambda b: b.find_element(By.ID, "live").get_attribute("data-seen")
                        is None)  # swapped once more since
    kept = browser.find_element(By.ID, "event-payload-1")
    assert kept.get_attribute("open") is not None
    assert "SECRET-1" in kept.find_element(By.CSS_SELECTOR, "pre.event-payload").text
    assert browser.execute_script(PAYLOAD_READS, url) == 1  # never read again
    assert "SECRET-2" not in browser.find_element(By.ID, "events").text  # not opened
