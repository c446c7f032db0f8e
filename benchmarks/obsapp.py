"""``benchapp`` observed as ``BENCH_OBSERVE`` says (``benchmarks.observers``: ``off``,
``metrics``, ``on``), the workers' app of ``benchmarks.observability``."""

from __future__ import annotations

import os

from benchmarks.observers import configure

configure(os.environ.get("BENCH_OBSERVE", "on"))

from benchmarks.benchapp import app, pikku, plain_noop  # noqa: E402 - after the observers are chosen

__all__ = ["app", "pikku", "plain_noop"]
