"""``./dev celery-suite``: Celery's own integration tests, Celery alone and with pikku bound.

Binding pikku to an app must not change how the app's own tasks behave. The strongest
check at hand is Celery's own ``t/integration`` suite, taken from the sdist of the installed
Celery version (``pip download --no-binary :all: --no-deps celery==<version>``; no
repository checkout): ``test_tasks``, ``test_canvas``, ``test_backend`` and
``test_inspect`` run twice,

* ``alone``: the suite as Celery runs it;
* ``bound``: the same, with ``tests/celery_suite/plugin.py`` binding a ``PikkuCelery`` to
  the suite's session app (the app its worker runs), then running one workflow on that
  worker at the end;

on RabbitMQ (a private vhost, deleted afterwards, so no other worker on the machine answers
the suite's broadcasts) with Celery's MongoDB result backend on a real ``mongod`` (a private
single-node replica set, or ``PIKKU_TEST_MONGO_URL``'s server), and prints a test-by-test
comparison. It exits 1 when an outcome differs. Each mode takes about 16 minutes on this
project's machines.

The suite's own test dependencies that the project does not carry (pydantic for its task
module, pytest-rerunfailures for its ``flaky`` marks, azure-core for an import of
``test_backend``) are installed into the work directory with ``pip --target``, never
into the project's environment. The sdist's copy of the ``celery`` package is removed, so
the installed Celery is the one tested.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celery
import redis

from tests.celery_suite import plugin
from tests.support.mongod import mongo_target

ROOT = Path(__file__).resolve().parents[2]
SUITE_FILES = ("test_tasks.py", "test_canvas.py", "test_backend.py", "test_inspect.py")
# Versions the sdist pins (requirements/extras/pydantic.txt, requirements/test.txt), and
# azure-core: test_backend.py imports Celery's Azure backend, whose kombu transport needs it
# (the Azure tests themselves skip without AZUREBLOCKBLOB_URL).
EXTRA_REQUIREMENTS = (("pydantic==2.14.1", True), ("pytest-rerunfailures==16.7", False),
                      ("azure-core==1.41.0", True))
RABBIT_HOST = "127.0.0.1:5672"
REDIS_URL = os.environ.get("PIKKU_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PER_TEST_TIMEOUT_S = 300  # test_expired hung forever under the old app-wide prefetch
MODE_TIMEOUT_S = 60 * 60
MODES = ("alone", "bound")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev celery-suite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path,
                        default=Path(tempfile.gettempdir()) / "pikku-celery-suite",
                        help="where the sdist, its extra dependencies and the reports go "
                             "(kept between runs; default: %(default)s)")
    parser.add_argument("--mode", choices=(*MODES, "both"), default="both")
    args, pytest_args = parser.parse_known_args(argv)  # the rest goes to pytest: -k, -x...

    version = celery.__version__
    workdir: Path = args.workdir.resolve()
    suite = fetch_suite(version, workdir)
    site = install_extras(workdir)
    modes = MODES if args.mode == "both" else (args.mode,)
    print(f"celery-suite: Celery {version}, {', '.join(SUITE_FILES)}; reports in {workdir}",
          flush=True)
    with services() as env:
        for mode in modes:
            run_mode(mode, suite, site, workdir, env, pytest_args)
    reports = {mode: read_junit(workdir / f"{mode}.xml") for mode in modes}
    text = compare(reports, workdir)
    print(text)
    (workdir / "comparison.txt").write_text(text + "\n")
    if len(modes) == 2:
        return 0 if reports["alone"] == reports["bound"] else 1
    return 0


# --- the suite ------------------------------------------------------------------------------


def fetch_suite(version: str, workdir: Path) -> Path:
    """The sdist's root directory, downloaded and unpacked once per version."""
    root = workdir / f"celery-{version}"
    if (root / "t" / "integration").is_dir():
        return root
    workdir.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:",
                    "--no-deps", f"celery=={version}", "-d", str(workdir)], check=True)
    archive = next(workdir.glob(f"celery-{version}.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(workdir, filter="data")
    # Test the installed Celery, not the sdist's copy of its source.
    shutil.rmtree(root / "celery", ignore_errors=True)
    shutil.rmtree(root / "celery.egg-info", ignore_errors=True)
    return root


def install_extras(workdir: Path) -> Path:
    site = workdir / "site"
    stamp = site / ".installed"
    if stamp.exists():
        return site
    for requirement, with_deps in EXTRA_REQUIREMENTS:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", str(site), requirement]
        if not with_deps:
            cmd.append("--no-deps")  # never a second pytest shadowing the project's
        subprocess.run(cmd, check=True)
    stamp.touch()
    return site


@contextlib.contextmanager
def services() -> Iterator[dict[str, str]]:
    """A private RabbitMQ vhost, a private mongod and a Redis key prefix, all removed after."""
    tag = uuid.uuid4().hex[:8]
    vhost = f"pikku-celery-suite-{tag}"
    prefix = f"pikku-celery-suite-{tag}"
    with mongo_target() as mongo:
        yield from _with_vhost(vhost, prefix, mongo)


def _with_vhost(vhost: str, prefix: str, mongo: Any) -> Iterator[dict[str, str]]:
    rabbitmqctl("add_vhost", vhost)
    try:
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield {
            "TEST_BROKER": f"pyamqp://guest:guest@{RABBIT_HOST}/{vhost}",
            "TEST_BACKEND": mongo.url_for("celery_suite"),
            plugin.ENV_MONGO: mongo.url_for("pikku_suite"),
            plugin.ENV_REDIS: REDIS_URL,
            plugin.ENV_PREFIX: prefix,
        }
    finally:
        with contextlib.suppress(Exception):
            rabbitmqctl("delete_vhost", vhost)
        with contextlib.suppress(Exception):
            client = redis.Redis.from_url(REDIS_URL)
            doomed = list(client.scan_iter(match=f"{prefix}:*", count=1000))
            if doomed:
                client.delete(*doomed)


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, timeout=60)


def run_mode(mode: str, suite: Path, site: Path, workdir: Path, services_env: dict[str, str],
             extra: list[str]) -> None:
    junit, log, report = (workdir / f"{mode}.{ext}" for ext in ("xml", "log", "workflow.json"))
    for path in (junit, report):
        path.unlink(missing_ok=True)
    env = {**os.environ, **services_env, plugin.ENV_REPORT: str(report),
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:celery", "-p", "celery.contrib.pytest",
           "-p", "no:cacheprovider", f"--timeout={PER_TEST_TIMEOUT_S}",
           f"--junitxml={junit}", "-q", "-rfE",
           *(("-p", "tests.celery_suite.plugin") if mode == "bound" else ()),
           *extra, *(f"t/integration/{name}" for name in SUITE_FILES)]
    print(f"celery-suite: running {mode} (log: {log})", flush=True)
    started = time.monotonic()
    with open(log, "wb") as out:
        try:
            subprocess.run(cmd, cwd=suite, env=env, stdout=out, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, timeout=MODE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"celery-suite: {mode} did not finish within {MODE_TIMEOUT_S}s", flush=True)
    tail = log.read_text(errors="replace").strip().splitlines()[-1:]
    print(f"celery-suite: {mode} took {time.monotonic() - started:.0f}s: "
          f"{tail[0] if tail else '(no output)'}", flush=True)
    if mode == "bound":
        outcome = json.loads(report.read_text()) if report.exists() else {
            "status": "not run (the session worker never started?)"}
        print(f"celery-suite: pikku workflow on the suite's worker: {outcome}", flush=True)


# --- the comparison -------------------------------------------------------------------------


def read_junit(path: Path) -> dict[str, str]:
    """Test id -> outcome (passed, failed, error, skipped, xfailed) from a JUnit report."""
    if not path.exists():
        return {}
    outcomes: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        # A teardown error is reported as a second entry of the same test: keep the worse.
        if outcomes.get(test_id) not in (None, "passed"):
            continue
        outcomes[test_id] = outcome
    return outcomes


def compare(reports: dict[str, dict[str, str]], workdir: Path) -> str:
    modes = list(reports)
    ids = sorted(set().union(*(r.keys() for r in reports.values())))
    lines = [f"{'  '.join(f'{m:<8}' for m in modes)}  test"]
    differing = 0
    for test_id in ids:
        outcomes = [reports[m].get(test_id, "missing") for m in modes]
        mark = ""
        if len(set(outcomes)) > 1:
            differing += 1
            mark = "   <-- differs"
        lines.append(f"{'  '.join(f'{o:<8}' for o in outcomes)}  {test_id}{mark}")
    lines.append("")
    for m in modes:
        counts: dict[str, int] = {}
        for outcome in reports[m].values():
            counts[outcome] = counts.get(outcome, 0) + 1
        summary = ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
        lines.append(f"{m}: {len(reports[m])} tests: {summary or 'no report'}")
    if len(modes) == 2:
        lines.append(f"{differing} test(s) differ between {modes[0]} and {modes[1]}")
    failures = {m: sorted(t for t, o in reports[m].items() if o in ("failed", "error"))
                for m in modes}
    for m in modes:
        lines.append(f"{m} failures: " + (", ".join(failures[m]) or "none"))
    lines.append(f"logs and JUnit reports: {workdir}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
