"""The types an editor follows (issue 36, item 4): ``tests/typing/public_api.py`` is clean
under ``mypy --strict`` and ``pyright``, and every line of ``tests/typing/wrong_argument.py``
marked ``# expected error`` is reported by both, so the test fails if a step's types
degrade to ``Any`` (then nothing would be reported)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TYPING = Path(__file__).resolve().parent.parent / "typing"
ROOT = TYPING.parent.parent
CLEAN, WRONG = TYPING / "public_api.py", TYPING / "wrong_argument.py"


def _expected_lines() -> set[int]:
    lines = WRONG.read_text().splitlines()
    marked = {n for n, line in enumerate(lines, 1) if "# expected error" in line}
    assert len(marked) >= 4
    return marked


def _mypy(path: Path) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary",
         "--python-version", "3.11", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    return done.returncode, done.stdout + done.stderr


def _pyright() -> str:
    found = shutil.which("pyright", path=str(Path(sys.executable).parent)) or shutil.which(
        "pyright")
    if found is None:
        why = "pyright is not installed (it is in the dev extra: pip install -e .[dev])"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI installs the dev extra: a missing checker is a failure
        pytest.skip(why)
    return found


def _pyright_errors(path: Path) -> list[dict[str, object]]:
    done = subprocess.run(
        [_pyright(), "--outputjson", "-p", str(TYPING / "pyrightconfig.json"),
         "--pythonpath", sys.executable, str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright gave no report: {done.stdout[-2000:]} {done.stderr[-2000:]}")
    return [d for d in report["generalDiagnostics"] if d["severity"] == "error"]


def test_mypy_strict_finds_the_public_api_clean() -> None:
    code, output = _mypy(CLEAN)
    assert code == 0, output


def test_mypy_reports_every_wrong_argument() -> None:
    code, output = _mypy(WRONG)
    assert code == 1, output
    reported = {int(m.group(1)) for m in re.finditer(
        rf"{re.escape(WRONG.name)}:(\d+): error", output)}
    assert reported == _expected_lines(), output


def test_pyright_finds_the_public_api_clean() -> None:
    errors = _pyright_errors(CLEAN)
    assert errors == []


def test_pyright_reports_every_wrong_argument() -> None:
    errors = _pyright_errors(WRONG)
    reported = {int(e["range"]["start"]["line"]) + 1 for e in errors}  # type: ignore[index]
    assert reported == _expected_lines(), errors
