"""Takes the pictures of ``docs/guide/observability.md`` from a real run, with the real tools.

    .venv/bin/python tools/observability_pictures.py [--runs 60] [--spread 60]

Starts (or reuses) Redis and a mongod (``example_project.stack``), one
``celery -A example_project.observed worker -E`` (spans to a file, metrics on a port), Flower
beside it and a Prometheus server scraping the worker; runs the example's order workflows
(started over a minute); then writes, under ``docs/``: ``observability-flower.png``
(Flower's task list),
``observability-prometheus.png`` (a PromQL graph of step attempts by outcome) and
``observability-trace.txt`` (one run's trace as a tree, from the spans the worker exported).
Stops everything it started. Needs Debian's ``chromium``, ``chromium-driver`` and
``prometheus`` (``./dev services`` installs them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from example_project.stack import Stack, free_port  # noqa: E402
from tests.support.browser import chromium  # noqa: E402

QUERY = "sum by (outcome) (rate(pikku_step_attempts_total[1m]))"


def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"{url} did not answer within {timeout_s:.0f} s")


def _spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=env, cwd=ROOT)


def _trace_tree(spans_file: Path, run_id: str) -> str:
    """The spans of ``run_id``'s trace, indented by parent, with their durations."""
    spans = [json.loads(line) for line in spans_file.read_text().splitlines() if line]
    trace_ids = {s["context"]["trace_id"] for s in spans
                 if s.get("attributes", {}).get("pikku.run_id") == run_id}
    mine = [s for s in spans if s["context"]["trace_id"] in trace_ids]
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    ids = {s["context"]["span_id"] for s in mine}
    for span in mine:
        parent = span.get("parent_id")
        children[parent if parent in ids else None].append(span)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for span in sorted(children[parent], key=lambda s: s["start_time"]):
            attrs = span.get("attributes", {})
            shown = {k.removeprefix("pikku."): v for k, v in attrs.items()
                     if k in ("pikku.step", "pikku.attempt", "pikku.outcome", "pikku.in_place")}
            lines.append(f"{'  ' * depth}{span['name']}  {shown if shown else ''}".rstrip())
            walk(span["context"]["span_id"], depth + 1)

    walk(None, 0)
    return "\n".join(lines) + "\n"


def _wait_for_series(prom_port: int, timeout_s: float = 60.0) -> None:
    """Until Prometheus has scraped enough for ``QUERY`` to have a value per outcome."""
    url = (f"http://127.0.0.1:{prom_port}/api/v1/query?"
           + urllib.parse.urlencode({"query": QUERY}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as answer:
            result = json.load(answer)["data"]["result"]
        if any(float(r["value"][1]) > 0 for r in result):
            time.sleep(10)  # and a few more points on the graph
            return
        time.sleep(1)
    raise SystemExit(f"Prometheus had no series for {QUERY} within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--spread", type=float, default=60.0,
                        help="seconds over which the runs are started")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pikku-pictures-"))
    procs: list[subprocess.Popen[bytes]] = []
    with Stack() as stack:
        tag = uuid.uuid4().hex[:8]
        metrics_port, flower_port, prom_port = free_port(), free_port(), free_port()
        env = {**os.environ, "PIKKU_REDIS_URL": stack.redis_url,
               "PIKKU_MONGO_URL": stack.mongo_url, "PIKKU_KEY_PREFIX": f"pikku-pics-{tag}",
               "PIKKU_QUEUE": f"pikku-pics-{tag}", "PIKKU_SPANS_FILE": str(work / "spans.jsonl"),
               "PIKKU_METRICS_PORT": str(metrics_port)}
        os.environ.update({k: v for k, v in env.items() if k.startswith("PIKKU_")})
        try:
            procs.append(_spawn([sys.executable, "-m", "celery", "-A",
                                 "example_project.observed", "worker", "-E", "-P", "threads",
                                 "-c", "4", "-n", f"pics-{tag}@%h", "--loglevel", "INFO",
                                 "--without-gossip", "--without-mingle"],
                                work / "worker.log", env))
            procs.append(_spawn([sys.executable, "-m", "celery", "-A",
                                 "example_project.observed", "flower", f"--port={flower_port}",
                                 "--address=127.0.0.1"], work / "flower.log", env))
            (work / "prometheus.yml").write_text(
                "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: pikku\n"
                f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n")
            procs.append(_spawn([shutil.which("prometheus") or "prometheus",
                                 f"--config.file={work / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={work / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                work / "prometheus.log", env))
            _wait_http(f"http://127.0.0.1:{metrics_port}/metrics")
            _wait_http(f"http://127.0.0.1:{flower_port}/")
            _wait_http(f"http://127.0.0.1:{prom_port}/-/ready")
            from example_project.observed import pikku  # with the environment set above

            # Spread over a minute, so the graph has a shape (a counter that appears with
            # all its counts at its first scrape has no rate).
            run_ids = []
            for i in range(args.runs):
                run_ids.append(pikku.start("order", {
                    "order_id": f"o-{i}", "items": ["book"], "amount": 10 + i,
                    "card": "declined" if i % 6 == 5 else "visa"}))
                time.sleep(args.spread / args.runs)
            for run_id in run_ids:
                pikku.wait(run_id, timeout=120)
            _wait_for_series(prom_port)
            (ROOT / "docs" / "observability-trace.txt").write_text(
                _trace_tree(work / "spans.jsonl", run_ids[0]))
            with chromium(work / "profile") as browser:
                browser.set_window_size(1280, 1150)
                browser.get(f"http://127.0.0.1:{flower_port}/tasks")
                time.sleep(3)
                browser.save_screenshot(str(ROOT / "docs" / "observability-flower.png"))
                query = urllib.request.quote(QUERY)
                browser.get(f"http://127.0.0.1:{prom_port}/graph?g0.expr={query}&g0.tab=0"
                            "&g0.range_input=2m")
                time.sleep(8)  # the page runs the query and draws the graph
                browser.save_screenshot(str(ROOT / "docs" / "observability-prometheus.png"))
            print(f"pictures written under docs/ (logs in {work})")
            return 0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            _forget(stack.redis_url, f"pikku-pics-{tag}")


def _forget(redis_url: str, prefix: str) -> None:
    """Delete this run's keys (leases, its queue) from a Redis it may share."""
    import redis

    client = redis.Redis.from_url(redis_url)
    doomed = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if doomed:
        client.delete(*doomed)


if __name__ == "__main__":
    sys.exit(main())
