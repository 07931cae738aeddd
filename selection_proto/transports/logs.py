"""Structured logs: one JSON object per line on stderr (transports.md §7.3)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

__all__ = ["LEVELS", "log", "set_log_level"]

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
_threshold = {"level": LEVELS["info"]}  # set once by the CLI from --log-level


def set_log_level(level: str) -> None:
    _threshold["level"] = LEVELS[level]


def log(level: str, event: str, **fields: Any) -> None:
    """One JSON object per line on stderr (transports.md §7.3)."""
    if LEVELS[level] < _threshold["level"]:
        return
    record = {"ts": round(time.time(), 3), "level": level, "event": event, **fields}
    print(json.dumps(record, separators=(",", ":")), file=sys.stderr, flush=True)
