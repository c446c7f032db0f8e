"""Retrying a failed run and forking it from the dashboard in a real headless Chromium
(issue 25 item 2): the run page of a failed run offers Retry, whose click runs the run
again and comes back with the notice; the Fork form's step select and run id field start
a new run, and the browser lands on its page. Same setup as ``test_dashboard_browser.py``
(Flask, ``PikkuFlask``, Werkzeug on a loopback port, in-memory services, Debian's
chromium)."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, redirect, session
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import Select
from werkzeug.serving import make_server

from pikku_celery import PikkuCelery
from pikku_celery.contrib.flask import PikkuFlask
from tests.integration.test_dashboard_browser import CHROMIUM_FLAGS, wait
from tests.support.mongod import free_port
from tests.unit.test_contrib import authorize, make_pikku

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pikku() -> PikkuCelery:
    return make_pikku()


@pytest.fixture(scope="module")
def base_url(pikku: PikkuCelery) -> Iterator[str]:
    app = Flask("dashboard-retry-browser")
    app.config.update(SECRET_KEY=os.urandom(16), PIKKU_AUTHORIZE=authorize)
    PikkuFlask(pikku).init_app(app)

    @app.get("/login/<user>")
    def login(user: str) -> Any:
        session["user"] = user
        return redirect("/pikku/")

    server = make_server("127.0.0.1", free_port(), app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver_path, ("Debian's chromium and chromium-driver are needed "
                                      "(./dev test installs them)")
    options = Options()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium must not look for downloads
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    yield driver
    driver.quit()


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
