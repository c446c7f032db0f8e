"""Deciding an approval gate on the dashboard in a real headless Chromium (issue 25 item
3): the run page shows the gate (name, approvers, schema), offers no Resume, keeps a
decision being typed across the page's refresh, refuses a decision its schema refuses
with the reason and the text as typed, and records one it takes, as the signed-in user.
Same setup as ``test_dashboard_browser.py`` (Flask, ``PikkuFlask``, Werkzeug on a
loopback port, in-memory services, Debian's chromium), with ``PIKKU_IDENTIFY`` naming the
signed-in user."""

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
from werkzeug.serving import make_server

from pikku_celery import PikkuCelery
from pikku_celery.contrib.flask import PikkuFlask
from tests.integration.test_dashboard_browser import CHROMIUM_FLAGS, wait
from tests.support.mongod import free_port
from tests.unit.test_contrib import authorize, identify, make_pikku

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pikku() -> PikkuCelery:
    return make_pikku()


@pytest.fixture(scope="module")
def base_url(pikku: PikkuCelery) -> Iterator[str]:
    app = Flask("dashboard-approvals-browser")
    app.config.update(SECRET_KEY=os.urandom(16), PIKKU_AUTHORIZE=authorize,
                      PIKKU_IDENTIFY=identify)
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

    textarea = gate.find_element(By.CSS_SELECTOR, 'textarea[name="decision"]')
    textarea.send_keys('"yes"')
    # The live page re-reads itself every few seconds: a decision being typed survives.
    wait(browser).until(ec.staleness_of(browser.find_element(By.ID, "live")))
    assert textarea.get_attribute("value") == '"yes"'
    gate.find_element(By.CSS_SELECTOR, "form.decide button").click()
    refused = wait(browser).until(ec.presence_of_element_located((By.ID, "decision-refused")))
    assert "does not match its schema" in refused.text
    kept = browser.find_element(By.CSS_SELECTOR, 'textarea[name="decision"]')
    assert kept.get_attribute("value") == '"yes"'
    assert pikku.get_run(run_id).status == "suspended"

    kept.clear()
    kept.send_keys("true")
    browser.find_element(By.CSS_SELECTOR, "form.decide button").click()
    notice = wait(browser).until(ec.presence_of_element_located((By.ID, "notice")))
    assert notice.text == "decision recorded"
    decided = browser.find_element(By.CSS_SELECTOR, '.gate[data-gate="manager"]')
    assert decided.get_attribute("data-status") == "decided"
    assert "by admin" in decided.text
    assert not browser.find_elements(By.CSS_SELECTOR, 'textarea[name="decision"]')
    assert pikku.get_run(run_id).status == "running"
    [gate_step] = pikku.get_steps(run_id)
    assert gate_step.result is True
