"""Taking connections in while descriptors last: the budget of connections that the process's
open-files limit allows the HTTP API and the picker together, the accept loop that backs off when
the machine has no descriptors or buffers left, and log lines that say so once per interval
instead of once per retry (docs/DECISIONS.md, "Bounds")."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, NoReturn, TypeVar

import anyio

from .logs import log

__all__ = ["ACCEPT_BACKOFF_MAX", "ACCEPT_BACKOFF_START", "FD_HEADROOM", "Throttled", "accept_forever",
           "connection_budget"]

ACCEPT_BACKOFF_START: Final = 0.01
ACCEPT_BACKOFF_MAX: Final = 1.0
LOG_INTERVAL_SECS: Final = 1.0
FD_HEADROOM: Final = 64  # descriptors beside connections and subscriptions: listeners, logs, ledger, pipes

_Accepted = TypeVar("_Accepted")


def connection_budget(subscriptions: int) -> float:
    """How many connections, HTTP and picker together, the soft RLIMIT_NOFILE leaves room for
    beside `subscriptions` and `FD_HEADROOM` (infinite where the limit is unknown)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Linux or macOS
        return float("inf")
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return float("inf")
    return max(1, soft - FD_HEADROOM - subscriptions)


class Throttled:
    """A warning logged at most once per `LOG_INTERVAL_SECS`, with how many times it happened
    since the last line: a flood of refusals or failed accepts costs a line a second, not one each."""

    def __init__(self, event: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.event, self.clock = event, clock
        self.count = 0
        self.logged = float("-inf")

    def __call__(self, **fields: Any) -> None:
        self.count += 1
        now = self.clock()
        if now - self.logged >= LOG_INTERVAL_SECS:
            log("warning", self.event, times=self.count, **fields)
            self.count, self.logged = 0, now


async def accept_forever(accept: Callable[[], Awaitable[_Accepted]], start: Callable[[_Accepted], None],
                         failed: Callable[[OSError], None], where: str) -> NoReturn:
    """Accept and `start` each connection until cancelled. Running out of descriptors or buffers
    (EMFILE, ENFILE, ENOBUFS...) is the machine's state, not a reason to stop: `failed` counts it,
    and accepting waits from `ACCEPT_BACKOFF_START` doubling to `ACCEPT_BACKOFF_MAX`, logged once
    per interval with no traceback (asyncio's own accept loop logged one per retry)."""
    warn = Throttled("accept_failed")
    delay = ACCEPT_BACKOFF_START
    while True:
        try:
            connection = await accept()
        except OSError as exc:
            failed(exc)
            warn(listener=where, errno=exc.errno, detail=exc.strerror or str(exc), retry_in_secs=delay)
            await anyio.sleep(delay)
            delay = min(ACCEPT_BACKOFF_MAX, delay * 2)
            continue
        delay = ACCEPT_BACKOFF_START
        start(connection)
