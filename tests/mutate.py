"""Mutation testing of the core (``./dev mutate``): does a broken line fail a fast test?

    ./dev mutate [MODULE ...] [--max-children N]

MODULE is any of the core modules below (default: all of them). mutmut (pinned in the test
extras) mutates every line of those modules, one mutant at a time, and runs the fast tests
that execute that line: ``tests/unit`` and ``tests/contract`` on the in-memory store, the
real ``mongod`` (one single-node replica set started for the whole run and handed to every
test process as ``PIKKU_TEST_MONGO_URL``), mongomock where a test uses it, and the local
Redis (the nx-27017 wire tests, where any remain, are left out: they test the stand-in).
A mutant no test fails "survived": the command prints each survivor's diff. A run that
tests nothing (mutmut fails, or checks no mutant) fails loudly; it never reads "0 survived".
docs/reliability.md lists the last run's survivors and why each is equivalent or harmless.

It works in a scratch copy of the working tree (``$TMPDIR/pikku-mutate-*``): mutmut writes
its ``mutants/`` tree and caches there, never in the tree other people are editing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from tests.support.mongod import mongo_target

ROOT = Path(__file__).resolve().parents[1]
CORE = {
    "claims": ["pikku_celery/engine/claims.py"],
    "store": ["pikku_celery/store/*"],
    "leases": ["pikku_celery/leases/*"],
    "heartbeat": ["pikku_celery/engine/heartbeat.py"],
    "reaper": ["pikku_celery/engine/reaper.py"],
    "replay": ["pikku_celery/workflow/replay.py"],
    "tasks": ["pikku_celery/worker/tasks.py"],
    # Smaller groups for one change's modules (issue 21: a run's end, graph rounds).
    "ended": ["pikku_celery/store/_ended.py"],
    "graph": ["pikku_celery/workflow/_graph_rounds.py", "pikku_celery/workflow/graph.py"],
}
TESTS = ["tests/unit", "tests/contract"]
# Deselected everywhere: the wire stand-in (its own server process); tests
# that look at the code itself, which mutmut's trampolines change even with no mutant active
# (a class's method list, a traceback's length); tests that run the code in a subprocess
# (it cannot find mutmut's configuration there): the testing kit's and Django's, which test
# integrations, not the core.
DESELECT = " and ".join(f"not {name}" for name in (
    "wire", "too_large_as_bson", "from_url_opens_no_connection",
    "every_store_query_is_served_by_a_declared_index", "result_too_large_beside_the_data",
    "test_testing_kit", "test_contrib_django"))
CONFIG = """
[tool.mutmut]
source_paths = ["pikku_celery"]
only_mutate = {only}
pytest_add_cli_args_test_selection = {tests}
# A heartbeat thread of a test that already ended can die under mutmut's trampolines: the
# suite's own rule (a thread's exception fails the test) is for the code, not for mutmut.
pytest_add_cli_args = ["-p", "no:cacheprovider", "-k", "{deselect}",
                       "-W", "ignore::pytest.PytestUnhandledThreadExceptionWarning"]
process_isolation = "forkserver"
use_git_change_detection = false
# Tests read the examples of the README and the docs pages (tests/support/readme.py): without
# them in mutmut's copy the clean run fails, and a clean run that fails tests no mutant at all.
also_copy = ["README.md", "docs"]
# A mutant that makes its tests three times slower counts as caught (a timeout): a lease or
# heartbeat mutant that stops renewals otherwise waits out every event bound of its tests.
timeout_multiplier = 3.0
timeout_constant = 2.0
# Verbose: without it the clean run (mutmut's output capture around pytest) fails for some
# module sets with no word of why. The output goes to a log file, not the console.
debug = true
"""
LOG = ROOT / ".pikku-run" / "mutate.log"  # .pikku-run/ is git-ignored


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", choices=[[], *CORE], metavar="MODULE",
                        help=f"any of {', '.join(CORE)} (default: all)")
    parser.add_argument("--max-children", type=int, default=2)
    args = parser.parse_args(argv)
    modules = args.modules or list(CORE)
    # Stopped (a timeout, Ctrl-C): still remove the scratch copy on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    scratch = Path(tempfile.mkdtemp(prefix="pikku-mutate-"))
    started = time.monotonic()
    stack = contextlib.ExitStack()
    try:
        _copy_tree(scratch)
        only = [glob for m in modules for glob in CORE[m]]
        with open(scratch / "pyproject.toml", "a") as config:
            config.write(CONFIG.format(only=_toml(only), tests=_toml(TESTS),
                                       deselect=DESELECT))
        LOG.parent.mkdir(exist_ok=True)
        print(f"mutate: {', '.join(modules)} against {' '.join(TESTS)} in {scratch}; "
              f"mutmut's output in {LOG}", flush=True)
        mongo = stack.enter_context(mongo_target())
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PIKKU_TEST_MONGO_URL": mongo.url}
        with open(LOG, "wb") as log:
            mutmut = subprocess.Popen([sys.executable, "-m", "mutmut", "run",
                                       "--max-children", str(args.max_children)],
                                      cwd=scratch, env=env, start_new_session=True,
                                      stdout=log, stderr=subprocess.STDOUT)
            try:
                returncode = _wait_reporting(mutmut)
            finally:
                if mutmut.poll() is None:  # we were stopped: stop mutmut and its workers
                    os.killpg(mutmut.pid, signal.SIGTERM)
        took = time.monotonic() - started
        statuses = _statuses(scratch, env)
        failure = _failure(returncode, statuses)
        if failure:
            # A run that could not test is a failure, never "0 survived": say why, loudly.
            tail = LOG.read_bytes()[-4000:].decode(errors="replace").replace("\r", "\n")
            print(f"\nmutate: FAILED: {failure} ({took / 60:.1f} min); the end of {LOG}:\n"
                  f"{tail}", file=sys.stderr)
            return returncode or 1
        survivors = sorted(name for name, status in statuses.items() if status == "survived")
        counts = Counter(statuses.values())
        print(f"\nmutate: {', '.join(modules)}: {len(statuses)} mutants, "
              + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
              + f"; {took / 60:.1f} min")
        for name in survivors:
            shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=scratch,
                                   env=env, capture_output=True, text=True)
            print(f"\n--- survived: {name}\n{shown.stdout.strip()}")
        return 0
    finally:
        stack.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _wait_reporting(mutmut: subprocess.Popen[bytes]) -> int:
    """Wait for mutmut, printing its progress line once a minute."""
    while True:
        try:
            return mutmut.wait(timeout=60)
        except subprocess.TimeoutExpired:
            tail = LOG.read_bytes()[-20_000:].decode(errors="replace").replace("\r", "\n")
            progress = re.findall(r"\d+/\d+ .*", tail)
            if progress:
                print(f"mutate: {progress[-1].strip()}", flush=True)


def _copy_tree(scratch: Path) -> None:
    """The working tree as it is (tracked and new files, not ignored ones)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        source = ROOT / rel
        if source.is_file():
            target = scratch / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def _statuses(scratch: Path, env: dict[str, str]) -> dict[str, str]:
    """Every mutant mutmut knows, with its status (killed, survived, timeout, not checked...)."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                         cwd=scratch, env=env, capture_output=True, text=True).stdout
    found: dict[str, str] = {}
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep:
            found[name] = status
    return found


def _failure(returncode: int, statuses: dict[str, str]) -> str | None:
    """Why this run proves nothing, or None when it tested mutants and mutmut succeeded."""
    if returncode != 0:
        return f"mutmut exited with {returncode}"
    if not statuses:
        return "mutmut reported no mutant"
    tested = sum(1 for status in statuses.values() if status in _TESTED)
    if tested == 0:
        return f"none of {len(statuses)} mutants was tested"
    unchecked = sum(1 for status in statuses.values() if status == "not checked")
    if unchecked:
        return f"{unchecked} of {len(statuses)} mutants were never checked"
    return None


_TESTED = {"killed", "survived", "timeout", "caught by type check", "segfault"}


def _toml(items: list[str]) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"


if __name__ == "__main__":
    sys.exit(main())
