"""Settings for the example app, read from the environment (12-factor, no I/O here)."""

from __future__ import annotations

import os

REDIS_URL = os.environ.get("PIKKU_REDIS_URL", "redis://127.0.0.1:6379/0")
BROKER_URL = os.environ.get("PIKKU_BROKER_URL", REDIS_URL)
MONGO_URL = os.environ.get("PIKKU_MONGO_URL", "mongodb://127.0.0.1:27017/pikku_example")
KEY_PREFIX = os.environ.get("PIKKU_KEY_PREFIX", "pikku-example")
QUEUE = os.environ.get("PIKKU_QUEUE", "pikku-example")
STEP_LEASE_S = float(os.environ.get("PIKKU_STEP_LEASE", "60"))
REAPER_INTERVAL_S = float(os.environ.get("PIKKU_REAPER_INTERVAL", str(STEP_LEASE_S / 2)))
COURIER_SECONDS = float(os.environ.get("PIKKU_COURIER_SECONDS", "0.2"))
UNDISPATCHED_AFTER_S = float(os.environ.get("PIKKU_UNDISPATCHED_AFTER", "30"))
STALLED_AFTER_S = float(os.environ.get("PIKKU_STALLED_AFTER", "30"))
