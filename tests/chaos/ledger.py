"""Reading the ledger the chaos app's step bodies write (one JSON line per event)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_ledger(ledger_dir: Path) -> list[dict[str, Any]]:
    entries = []
    for path in ledger_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                entries.append(json.loads(line))
    entries.sort(key=lambda e: e["t"])
    return entries
