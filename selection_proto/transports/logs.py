"""Structured logs: one JSON object per line on stderr (transports.md §7.3)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

__all__ = ["LEVELS", "log", "log_internal_error", "set_log_level"]

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
_threshold = {"level": LEVELS["info"]}  # set once by the CLI from --log-level


def set_log_level(level: str) -> None:
    _threshold["level"] = LEVELS[level]


def log(level: str, event: str, **fields: Any) -> None:
    """One JSON object per line on stderr (transports.md §7.3)."""
    if LEVELS[level] < _threshold["level"]:
        return
    record = {"ts": round(time.time(), 3), "level": level, "event": event, **fields}
    # `default=str`: a log line never raises, whatever a caller passes.
    print(json.dumps(record, separators=(",", ":"), default=str), file=sys.stderr, flush=True)


def log_internal_error(where: str, detail: str) -> None:
    """An exception confined to one request, connection, stream or task, with its traceback."""
    log("error", "internal_error", where=where, traceback=detail)
