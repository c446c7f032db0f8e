"""``python -m tests.support.faketime_shim MODULE ARGS...``: run ``python -m MODULE ARGS``
under libfaketime with a ``time.sleep`` that works there.

libfaketime 0.9.10 (Debian 12) cannot serve a Python process both ways: with its monotonic
clock faked, ``threading`` waits (``sem_clockwait`` on ``CLOCK_MONOTONIC``) never return;
with it left alone (``FAKETIME_DONT_FAKE_MONOTONIC=1``, as ``netrig`` starts skewed
processes), ``time.sleep`` (``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)``, which
libfaketime rewrites with the wall-clock offset) fails with ``EINVAL``. This replaces
``time.sleep`` with a ``select`` timeout (relative, untouched by libfaketime); every
wall-clock read of the process stays skewed."""

from __future__ import annotations

import os
import runpy
import select
import sys
import time


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        select.select([], [], [], left)


if __name__ == "__main__":
    if os.environ.get("FAKETIME"):
        time.sleep = _sleep  # type: ignore[assignment]
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
