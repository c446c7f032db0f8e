"""Issue 33's proof of the metrics: a real Prometheus server (Debian's ``prometheus``)
scrapes two prefork workers (``celery -A ... worker -P prefork -c 2``, each in
prometheus-client's multiprocess mode, serving on ``pikku_metrics_port``) while they run
100 workflows; its HTTP API then gives the counts the store holds."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration import test_celery_workers as workers
from tests.integration.metricsapp import ENV_METRICS_PORT
from tests.integration.test_celery_workers import ROOT, Cluster, Worker, wait_for

make_cluster = workers.make_cluster  # real ``celery -A`` workers: that module's fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
RUNS = 100  # 80 runs of 3 steps, 20 of the 4-step pipeline whose flaky step fails once


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_worker(c: Cluster, name: str, port: int, tmp: Path) -> Worker:
    """A prefork worker of ``metricsapp`` in multiprocess mode, serving on ``port``."""
    multiproc = tmp / f"prom-{name}"
    multiproc.mkdir()
    log_path = tmp / f"{name}.log"
    env = {**c.env, ENV_METRICS_PORT: str(port), "PROMETHEUS_MULTIPROC_DIR": str(multiproc)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.integration.metricsapp", "worker",
             "-P", "prefork", "-c", "2", "-Q", c.queue, "-n", f"{name}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat",
             "--loglevel", "INFO"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    worker = Worker(name, "prefork", proc, log_path)
    c.workers.append(worker)  # stopped by the fixture, by its process group, whatever happens
    return worker


@contextlib.contextmanager
def _prometheus(tmp: Path, targets: list[str]) -> Iterator[str]:
    """A Prometheus server scraping ``targets`` every 0.5 s; its base URL. Stopped (by its
    PID) on the way out, however the test ends."""
    port = _free_port()
    config = tmp / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "500ms", "scrape_timeout": "400ms"},
        "scrape_configs": [{"job_name": "pikku", "static_configs": [{"targets": targets}]}],
    }))
    log_path = tmp / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is None and _ready(base), 30, "Prometheus to be ready",
                 lambda: log_path.read_text(errors="replace")[-3000:])
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def _scalar(base: str, promql: str) -> float:
    found = _query(base, promql)
    return float(found[0]["value"][1]) if found else 0.0


def test_prometheus_scrapes_two_prefork_workers_and_finds_the_store_s_counts(
        make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    c = make_cluster("redis")
    ports = [_free_port(), _free_port()]
    started = [_start_worker(c, f"metrics{i}", port, tmp_path) for i, port in enumerate(ports)]
    c.wait_ready(*started)
    for worker in started:  # each serves from its main process, in multiprocess mode
        wait_for(lambda w=worker: "pikku: metrics served on" in w.log(), 10,
                 f"{worker.name} to serve its metrics", c.diagnostics)

    with _prometheus(tmp_path, [f"127.0.0.1:{port}" for port in ports]) as prom:
        wait_for(lambda: _scalar(prom, "count(up == 1)") == 2, 20,
                 "Prometheus to scrape both workers", c.diagnostics)
        run_ids = [c.pikku.start("chain", {"n": 3}) for _ in range(RUNS - 20)]
        run_ids += [c.pikku.start("pipeline", {"a": 1, "b": 2, "fail": 1}) for _ in range(20)]
        for run_id in run_ids:
            assert c.wait(run_id, 60).status == "completed"

        # What the store holds: every attempt of every run, by outcome and step task.
        outcomes: Counter[tuple[str, str]] = Counter()
        for run_id in run_ids:
            functions = {s.step_name: s.function for s in c.pikku.get_steps(run_id)}
            for entry in c.pikku.get_history(run_id):
                function = functions.get(entry.step_name)
                if function is not None:
                    outcomes[function, entry.status] += 1
        assert outcomes[("it.flaky", "failed")] == 20  # each pipeline's first flaky attempt
        assert sum(outcomes.values()) == 80 * 3 + 20 * 4 + 20  # pipeline: sum, left, right, flaky

        def scraped() -> dict[tuple[str, str], float]:
            return {(r["metric"]["step"], r["metric"]["outcome"]): float(r["value"][1])
                    for r in _query(prom, "sum by (step, outcome) (pikku_step_attempts_total)")}

        expected = {key: float(n) for key, n in outcomes.items()}
        wait_for(lambda: scraped() == expected, 20,
                 "Prometheus to hold the store's attempt counts",
                 lambda: f"prometheus: {scraped()}\nstore: {expected}\n{c.diagnostics()}")

        def finished(workflow: str) -> float:
            return _scalar(prom, f'sum(pikku_runs_finished_total{{workflow="{workflow}",'
                                 'status="completed"})')

        wait_for(lambda: finished("chain") == 80 and finished("pipeline") == 20, 10,
                 "the runs' ends", c.diagnostics)
        assert _scalar(prom, "sum(pikku_step_attempt_duration_seconds_count)") == sum(
            outcomes.values())
        # Every run's end was a pass that ended it; a pass that found it ended already (a
        # late copy of a message, a wake under load) counts as "ended" too.
        ended = _scalar(prom, 'sum(pikku_pass_duration_seconds_count{outcome="ended"})')
        assert RUNS <= ended <= RUNS * 1.1, ended
        # Both workers' child processes counted (the main process runs no step).
        per_worker = _query(prom, "sum by (instance) (pikku_step_attempts_total)")
        assert {r["metric"]["instance"] for r in per_worker} == {
            f"127.0.0.1:{port}" for port in ports}
        # The store's runs, read at scrape time by each worker: none left running.
        wait_for(lambda: _query(prom, 'max(pikku_runs_active{workflow="chain",'
                                      'status="running"}) == 0'), 20,
                 "the runs-active gauge to read 0", c.diagnostics)
