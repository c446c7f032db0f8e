"""Retrying a failed run and forking it from the dashboard in a real headless Chromium
(issue 25 item 2): the run page of a failed run offers Retry, whose click runs the run
again and comes back with the notice; the Fork form's step select and run id field start
a new run, and the browser lands on its page. Same setup as ``test_dashboard_browser.py``
(Flask, ``PikkuFlask``, Werkzeug on a loopback port, in-memory services, Debian's
chromium)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import Select

from pikku_celery import PikkuCelery
from tests.integration.test_dashboard_browser import wait
from tests.support.browser import chromium, served_dashboard
from tests.unit.test_contrib import authorize, make_pikku

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pikku() -> PikkuCelery:
    return make_pikku()


@pytest.fixture(scope="module")
def base_url(pikku: PikkuCelery) -> Iterator[str]:
    with served_dashboard(pikku, "dashboard-retry-browser", PIKKU_AUTHORIZE=authorize) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def test_retry_and_fork_a_failed_run_with_the_buttons(pikku: PikkuCelery, browser: Any,
                                                      base_url: str) -> None:
    run_id = pikku.start("fails", None, inline=True, run_id="browser-failed")
    assert pikku.get_run(run_id).status == "failed"
    browser.delete_all_cookies()
    browser.get(f"{base_url}/login/admin")
    browser.get(f"{base_url}/pikku/runs/{run_id}")

    # Fork first (the run stays failed): its step, a new id, and the new run's page.
    step = wait(browser).until(ec.presence_of_element_located((By.ID, "fork-step")))
    Select(step).select_by_value("boom")
    browser.find_element(By.ID, "fork-run-id").send_keys("browser-forked")
    browser.find_element(By.ID, "fork").click()
    notice = wait(browser).until(ec.presence_of_element_located((By.ID, "notice")))
    assert notice.text == "run forked: this is the new run"
    assert "/pikku/runs/browser-forked?" in browser.current_url
    forked = pikku.get_run("browser-forked")
    assert (forked.workflow, forked.input) == ("fails", None)

    browser.get(f"{base_url}/pikku/runs/{run_id}")
    wait(browser).until(ec.element_to_be_clickable((By.ID, "retry"))).click()
    notice = wait(browser).until(ec.presence_of_element_located((By.ID, "notice")))
    assert notice.text == "run retried: it runs again from where it stopped"
    assert browser.current_url.endswith(f"/pikku/runs/{run_id}?notice=retried")
    assert pikku.get_run(run_id).status == "running"
    assert not browser.find_elements(By.ID, "retry")  # a live run is not retried
