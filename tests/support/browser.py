"""The dashboard's browser tests' shared parts: the dashboard served by Flask on a free
loopback port (with a ``/login/<user>`` route that signs a user in), and Debian's headless
Chromium driven by selenium (never a downloaded browser build)."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flask import Flask, redirect, session
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from werkzeug.serving import make_server

from pikku_celery import PikkuCelery
from pikku_celery.contrib.flask import PikkuFlask
from tests.support.mongod import free_port

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--window-size=1280,900")


@contextlib.contextmanager
def served_dashboard(pikku: PikkuCelery, name: str, **config: Any) -> Iterator[str]:
    """``pikku``'s dashboard and API in a Flask app named ``name`` (``config``: its
    settings, ``PIKKU_AUTHORIZE`` among them); yields the base URL."""
    app = Flask(name)
    app.config.update(SECRET_KEY=os.urandom(16), **config)
    PikkuFlask(pikku).init_app(app)

    @app.get("/login/<user>")
    def login(user: str) -> Any:
        session["user"] = user
        return redirect("/pikku/")

    server = make_server("127.0.0.1", free_port(), app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(timeout=10)


@contextlib.contextmanager
def chromium(profile: Path) -> Iterator[webdriver.Chrome]:
    """Debian's headless Chromium with its own profile directory ``profile``."""
    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    assert binary and driver_path, ("Debian's chromium and chromium-driver are needed "
                                    "(./dev test installs them)")
    options = Options()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium must not look for downloads
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def gone(element: Any) -> Any:
    """``expected_conditions.staleness_of``, which also knows Chromium's other word for a
    node of a page it left: a ``WebDriverException`` "Node with given id does not belong
    to the document" (seen in CI), where Selenium expects ``StaleElementReferenceException``
    and lets the wait fail."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    def check(_: Any) -> bool:
        try:
            element.is_enabled()
        except StaleElementReferenceException:
            return True
        except WebDriverException as exc:
            if "does not belong to the document" in str(exc):
                return True
            raise
        return False
    return check
