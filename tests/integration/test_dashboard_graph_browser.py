"""A graph workflow's run page in a real headless Chromium (issue 25 item 8): the graph is
drawn (its nodes, its edges, each node's visits as chips filled with their status's
colour), a step's input and result are read from the JSON API when its ``<details>`` is
opened (nothing of them in the page before), an opened step stays open and is read again
across a live page's refresh, and the runs page's time range and run id search narrow the
list. Same setup as ``test_dashboard_browser.py`` (Flask, ``PikkuFlask``, Werkzeug on a
loopback port, in-memory services, Debian's chromium)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec

from pikku_celery import PikkuCelery
from pikku_celery.store.base import NewRun
from tests.integration.test_dashboard_browser import wait
from tests.support.browser import chromium, gone, served_dashboard
from tests.unit.test_contrib import authorize, make_pikku
from tests.unit.test_dashboard_runs_detail import add_graphs

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

pytestmark = pytest.mark.slow

GREEN, RED = "rgb(34, 160, 90)", "rgb(220, 59, 59)"  # base.html's succeeded and failed


@pytest.fixture(scope="module")
def pikku() -> PikkuCelery:
    pikku = make_pikku()
    add_graphs(pikku)
    return pikku


@pytest.fixture(scope="module")
def base_url(pikku: PikkuCelery) -> Iterator[str]:
    with served_dashboard(pikku, "dashboard-graph-browser", PIKKU_AUTHORIZE=authorize) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory,
            base_url: str) -> Iterator[webdriver.Chrome]:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        driver.get(f"{base_url}/login/admin")
        yield driver


def _fill(element: Any) -> str:
    return str(element.value_of_css_property("fill"))


def test_the_graph_is_drawn_with_each_nodes_visits_coloured(
        pikku: PikkuCelery, browser: Any, base_url: str) -> None:
    run_id = pikku.start("shop", {"order": 7}, inline=True)
    browser.get(f"{base_url}/pikku/runs/{run_id}")
    graph = wait(browser).until(ec.visibility_of_element_located((By.ID, "graph")))
    nodes = {n.get_attribute("data-node"): n for n in
             graph.find_elements(By.CSS_SELECTOR, "g.node")}
    assert list(nodes) == ["list", "pack", "charge", "refund"]
    for node in nodes.values():
        box = node.find_element(By.CSS_SELECTOR, "rect.node-box")
        assert box.rect["width"] > 50 and box.rect["height"] > 20  # drawn, not collapsed
    # Left to right in layers: what follows a node is drawn to its right.
    xs = {name: n.find_element(By.CSS_SELECTOR, "rect.node-box").rect["x"]
          for name, n in nodes.items()}
    assert xs["list"] < xs["pack"] < xs["charge"] < xs["refund"]
    chips = {c.get_attribute("data-step"): _fill(c)
             for c in graph.find_elements(By.CSS_SELECTOR, "rect.visit")}
    assert chips == {"list": GREEN, "pack[0]": GREEN, "pack[1]": GREEN, "charge": RED,
                     "refund": GREEN}
    edges = [(e.get_attribute("data-source"), e.get_attribute("data-target"),
              e.get_attribute("data-kind"))
             for e in graph.find_elements(By.CSS_SELECTOR, "path.edge")]
    assert sorted(edges) == [("charge", "refund", "error"), ("list", "pack", "edge"),
                             ("pack", "charge", "edge")]
    error_edge = graph.find_element(By.CSS_SELECTOR, 'path.edge[data-kind="error"]')
    assert error_edge.value_of_css_property("stroke-dasharray") not in ("none", "")

    looped = pikku.start("tries", None, inline=True)
    browser.get(f"{base_url}/pikku/runs/{looped}")
    graph = wait(browser).until(ec.visibility_of_element_located((By.ID, "graph")))
    visits = graph.find_elements(By.CSS_SELECTOR, 'g.node[data-node="attempt"] rect.visit')
    assert [v.get_attribute("data-step") for v in visits] == ["attempt", "attempt#2",
                                                              "attempt#3"]
    assert graph.find_elements(By.CSS_SELECTOR, 'path.edge[data-kind="loop"]')


def test_a_steps_input_and_result_are_read_when_opened(
        pikku: PikkuCelery, browser: Any, base_url: str) -> None:
    run_id = pikku.start("shop", {"order": 7}, inline=True)
    browser.get(f"{base_url}/pikku/runs/{run_id}")
    box = wait(browser).until(ec.presence_of_element_located(
        (By.CSS_SELECTOR, 'details.values[data-step="pack[1]"]')))
    assert "packed cup" not in browser.page_source  # not in the page until asked for
    box.find_element(By.TAG_NAME, "summary").click()
    wait(browser).until(lambda _: box.get_attribute("data-loaded") == "yes")
    assert box.find_element(By.CSS_SELECTOR, ".step-result").text == '"packed cup"'
    shown_input = box.find_element(By.CSS_SELECTOR, ".step-input").text
    assert '"item": "cup"' in shown_input and '"order": 7' in shown_input
    failed = browser.find_element(By.CSS_SELECTOR, 'details.values[data-step="charge"]')
    failed.find_element(By.TAG_NAME, "summary").click()
    wait(browser).until(lambda _: failed.get_attribute("data-loaded") == "yes")
    error = failed.find_element(By.CSS_SELECTOR, ".step-error")
    assert error.is_displayed() and error.text == "RuntimeError: card declined"


def test_an_opened_step_stays_open_across_the_refresh(
        pikku: PikkuCelery, browser: Any, base_url: str) -> None:
    run_id = pikku.start("sum", {"a": 20, "b": 22}, run_id="graph-browser-live")
    pikku.engine.advance(run_id)  # records step "add"; no broker, so the run stays live
    browser.get(f"{base_url}/pikku/runs/{run_id}")
    box = wait(browser).until(ec.presence_of_element_located(
        (By.CSS_SELECTOR, 'details.values[data-step="add"]')))
    box.find_element(By.TAG_NAME, "summary").click()
    wait(browser).until(lambda _: box.get_attribute("data-loaded") == "yes")
    assert '"a": 20' in box.find_element(By.CSS_SELECTOR, ".step-input").text
    pikku.engine.execute_step(pikku.registry.steps["contrib.add"], run_id, "add")
    wait(browser).until(gone(box))  # #live swapped in
    again = browser.find_element(By.CSS_SELECTOR, 'details.values[data-step="add"]')
    assert again.get_attribute("open") is not None
    wait(browser).until(lambda _: again.find_element(
        By.CSS_SELECTOR, ".step-result").text == "42")


def test_the_runs_page_narrows_by_time_and_run_id(pikku: PikkuCelery, browser: Any,
                                                  base_url: str) -> None:
    for run_id, when in (("old-q1", "2025-01-05T10:00:00"), ("old-q2", "2025-02-05T10:00:00"),
                         ("old-r1", "2025-03-05T10:00:00")):
        moment = datetime.fromisoformat(when).replace(tzinfo=UTC)
        pikku.engine.store.create_run(NewRun(run_id, "sum", None),
                                      round(moment.timestamp() * 1000))
    browser.get(f"{base_url}/pikku/")
    field = wait(browser).until(ec.presence_of_element_located((By.ID, "run-id-search")))
    field.send_keys("old-q")
    browser.execute_script(
        "document.getElementById('created-before').value = '2025-02-01T00:00:00';")
    browser.find_element(By.CSS_SELECTOR, "form.filters button[type=submit]").click()
    wait(browser).until(ec.url_contains("run_id=old-q"))
    listed = [r.get_attribute("data-run-id")
              for r in browser.find_elements(By.CSS_SELECTOR, "#runs tr[data-run-id]")]
    assert listed == ["old-q1"]
    assert browser.find_element(By.ID, "run-id-search").get_attribute("value") == "old-q"
