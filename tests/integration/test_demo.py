"""The README's main command runs in CI: the demo must exit 0 and print the timelines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(200)
def test_the_demo_runs_end_to_end() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIKKU_")}
    done = subprocess.run(
        [sys.executable, "-m", "example_project.demo", "--runs", "6", "--timeout", "150"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "late write refused: WorkflowStepSupersededError" in out
    assert "timeline of run" in out
    assert "courier                attempt 2  succeeded" in out
    assert "runs by status: completed" in out
