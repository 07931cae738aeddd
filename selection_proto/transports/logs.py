"""Structured logs on stderr: one JSON object per line (transports.md §7.3), or with
`--log-format text` one line of `time level event key=value ...` for a terminal."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

__all__ = ["FORMATS", "LEVELS", "log", "log_internal_error", "set_log_format", "set_log_level"]

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
FORMATS = ("json", "text")
_threshold = {"level": LEVELS["info"]}  # set once by the CLI from --log-level
_format = {"text": False}  # set once by the CLI from --log-format


def set_log_level(level: str) -> None:
    _threshold["level"] = LEVELS[level]


def set_log_format(name: str) -> None:
    _format["text"] = name == "text"


def log(level: str, event: str, **fields: Any) -> None:
    """One JSON object per line on stderr (transports.md §7.3)."""
    if LEVELS[level] < _threshold["level"]:
        return
    now = time.time()
    if _format["text"]:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
        pairs = " ".join(f"{k}={v if isinstance(v, (int, float)) and not isinstance(v, bool) else _quoted(v)}"
                         for k, v in fields.items())
        _write(f"{stamp} {level:<7} {event} {pairs}".rstrip())
        return
    record = {"ts": round(now, 3), "level": level, "event": event, **fields}
    # `default=str`: a log line never raises, whatever a caller passes.
    _write(json.dumps(record, separators=(",", ":"), default=str))


def _write(line: str) -> None:
    """The line and its newline in one write: `--processes` share one stderr, and `print` writes
    the newline apart, so two processes' lines could run into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _quoted(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), default=str)
    if text and all(c.isalnum() or c in "-_./:[]@" for c in text):
        return text
    return json.dumps(text)


def log_internal_error(where: str, detail: str) -> None:
    """An exception confined to one request, connection, stream or task, with its traceback."""
    log("error", "internal_error", where=where, traceback=detail)
