"""The dashboard in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
driven by selenium; nothing downloaded): the runs page, a run whose step had a superseded
attempt (both attempts drawn, the supersession marked), cancelling a live run with its
button, auto-refresh without a reload, and anonymous access refused.

The app is a Flask app with the ``PikkuFlask`` extension served by Werkzeug on a free
loopback port, on in-memory store and leases; ``/login/<user>`` logs a browser in (the
test's ``PIKKU_AUTHORIZE`` reads the session: ``admin`` may do everything, ``reader`` only
read). With ``PIKKU_SCREENSHOTS=docs`` the screenshots the README shows are written to
``docs/``; otherwise they go to the test's temporary directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from pikku_celery import PikkuCelery, WorkflowContext
from tests.support.browser import chromium, served_dashboard
from tests.support.operate import now_ms, showcase_run, superseded_run
from tests.unit.test_contrib import authorize, make_pikku

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30  # an upper bound for the page to get there, never a duration asserted

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pikku() -> PikkuCelery:
    pikku = make_pikku()

    @pikku.workflow("order")
    def order(wf: WorkflowContext, data: Any) -> Any:  # the showcase runs' workflow
        return None

    return pikku


@pytest.fixture(scope="module")
def base_url(pikku: PikkuCelery) -> Iterator[str]:
    with served_dashboard(pikku, "dashboard-browser", PIKKU_AUTHORIZE=authorize) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


@pytest.fixture
def as_user(browser: webdriver.Chrome, base_url: str) -> Iterator[Any]:
    def login(user: str | None) -> webdriver.Chrome:
        browser.delete_all_cookies()
        if user is not None:
            browser.get(f"{base_url}/login/{user}")
        return browser
    yield login
    browser.delete_all_cookies()


def wait(browser: WebDriver) -> WebDriverWait[WebDriver]:
    """Wait for a condition; an element the page's refresh swapped between finding it and
    reading it (stale) is looked for again, not a failure."""
    return WebDriverWait(browser, WAIT_S, ignored_exceptions=(StaleElementReferenceException,))


def screenshot(browser: webdriver.Chrome, name: str, tmp_path: Path) -> Path:
    """A full-page PNG: into docs/ with ``PIKKU_SCREENSHOTS=docs``, else the tmp dir."""
    where = ROOT / "docs" if os.environ.get("PIKKU_SCREENSHOTS") == "docs" else tmp_path
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 1280, "height": int(height), "deviceScaleFactor": 1, "mobile": False})
    path = where / name
    try:
        assert browser.save_screenshot(str(path))
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    return path


def test_a_run_with_a_superseded_attempt_shows_both_attempts_and_the_mark(
        pikku: PikkuCelery, as_user: Any, base_url: str, tmp_path: Path) -> None:
    for i in range(3):
        pikku.start("sum", {"a": i, "b": 1}, inline=True)
    declined = showcase_run(pikku)  # a failed order, its error as users would see one
    pikku.engine.store.transition_run(declined, ["completed"], "failed", now_ms(), error={
        "type": "WorkflowRunFailedError",
        "message": "step 'charge' failed: CardDeclinedError: card ending 42 was declined"})
    showcase_run(pikku, live=True)
    shown = showcase_run(pikku)
    run_id = superseded_run(pikku)
    browser = as_user("admin")

    row = wait(browser).until(ec.presence_of_element_located(
        (By.CSS_SELECTOR, f'tr[data-run-id="{run_id}"]')))
    assert "completed" in row.text
    counts = {e.get_attribute("data-status"): e.text.split()[0]
              for e in browser.find_elements(By.CSS_SELECTOR, ".counts a[data-status]")}
    assert counts["completed"] == "5" and counts["failed"] == "1" and counts["running"] == "1"
    assert screenshot(browser, "dashboard-runs.png", tmp_path).stat().st_size > 10_000

    row.find_element(By.LINK_TEXT, run_id).click()
    wait(browser).until(ec.presence_of_element_located((By.ID, "timeline")))
    bars = browser.find_elements(By.CSS_SELECTOR, 'svg#timeline g.attempt[data-step="add"]')
    assert [(b.get_attribute("data-attempt"), b.get_attribute("data-outcome")) for b in bars] \
        == [("1", "superseded"), ("2", "succeeded")]
    marked = browser.find_elements(By.CSS_SELECTOR, "svg#timeline g.attempt.superseded")
    assert [m.get_attribute("data-attempt") for m in marked] == ["1"]
    mark = marked[0].find_element(By.CSS_SELECTOR, ".superseded-mark")
    assert mark.is_displayed() and mark.text == "✕ superseded"
    # Attempt 1's bar ends where attempt 2's claim fenced it out.
    first, second = (b.find_element(By.TAG_NAME, "rect") for b in bars)
    first_end = first.rect["x"] + first.rect["width"]
    assert abs(first_end - second.rect["x"]) < 2
    table = browser.find_element(By.CSS_SELECTOR, '#attempts tr.superseded[data-attempt="1"]')
    assert "worker-a@host1" in table.text and "WorkflowStepLeaseExpiredError" in table.text

    browser.get(f"{base_url}/pikku/runs/{shown}")
    wait(browser).until(ec.presence_of_element_located((By.ID, "timeline")))
    charge = browser.find_elements(By.CSS_SELECTOR, 'g.attempt[data-step="charge"]')
    assert [b.get_attribute("data-outcome") for b in charge] == [
        "superseded", "failed", "succeeded"]
    assert browser.find_elements(By.CSS_SELECTOR, 'g.row[data-kind="sleep"] rect.gap-sleep')
    assert screenshot(browser, "dashboard-run.png", tmp_path).stat().st_size > 10_000


def test_cancel_a_live_run_through_its_button(pikku: PikkuCelery, as_user: Any,
                                              base_url: str) -> None:
    run_id = showcase_run(pikku, live=True)
    browser = as_user("admin")
    browser.get(f"{base_url}/pikku/runs/{run_id}")
    assert browser.find_element(By.ID, "run-status").text == "running"
    browser.find_element(By.CSS_SELECTOR, '#cancel-form input[name="reason"]').send_keys(
        "customer called")
    browser.find_element(By.ID, "cancel").click()
    notice = wait(browser).until(ec.presence_of_element_located((By.ID, "notice")))
    assert notice.text == "run cancelled"
    assert browser.find_element(By.ID, "run-status").text == "cancelled"
    assert not browser.find_elements(By.ID, "cancel")
    run = pikku.get_run(run_id)
    assert run.status == "cancelled" and run.cancel_reason == "customer called"
    ship = browser.find_elements(By.CSS_SELECTOR, 'g.attempt[data-step="ship"]')
    assert [b.get_attribute("data-outcome") for b in ship] == ["cancelled"]


def test_the_runs_page_refreshes_itself_without_a_reload(pikku: PikkuCelery, as_user: Any,
                                                         base_url: str) -> None:
    browser = as_user("admin")
    wait(browser).until(ec.presence_of_element_located((By.ID, "runs")))
    browser.execute_script("window.pikkuNotReloaded = true")
    run_id = pikku.start("sum", {"a": 40, "b": 2}, inline=True)
    wait(browser).until(ec.presence_of_element_located(
        (By.CSS_SELECTOR, f'tr[data-run-id="{run_id}"]')))
    assert browser.execute_script("return window.pikkuNotReloaded") is True


def test_anonymous_and_read_only_visitors(pikku: PikkuCelery, as_user: Any,
                                          base_url: str) -> None:
    run_id = pikku.start("waits", {"secret": "input"}, inline=True)
    browser = as_user(None)
    for path in ("/pikku/", f"/pikku/runs/{run_id}"):
        browser.get(base_url + path)
        refused = wait(browser).until(ec.presence_of_element_located((By.ID, "refused")))
        assert "log in" in refused.text
        assert run_id not in browser.page_source and "secret" not in browser.page_source
    status = browser.execute_script(
        "return fetch(arguments[0], {method: 'POST', body: 'x=1', headers: "
        "{'Content-Type': 'application/x-www-form-urlencoded'}}).then(r => r.status)",
        f"{base_url}/pikku/runs/{run_id}/cancel")
    assert status == 401
    reader = as_user("reader")
    reader.get(f"{base_url}/pikku/runs/{run_id}")
    wait(reader).until(ec.presence_of_element_located((By.ID, "timeline")))
    assert not reader.find_elements(By.ID, "cancel") and not reader.find_elements(By.ID,
                                                                                 "resume")
    assert pikku.get_run(run_id).status == "suspended"
