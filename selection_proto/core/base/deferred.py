"""Work that waits until the answer is written: what a call changes that its own answer does not
depend on (a booking's predicted blocks; the picker's prefill mark and free as a response
passes), so that the transport writes the answer first and then runs
`SelectionService.deferred`. Every service call and every ledger input runs it first, so nothing
but the clock can tell deferred work from work done at once, in the order it would have been
done at once."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

__all__ = ["Deferred"]


class Deferred:
    """A queue of work run in order by `run`, once: work that calls the service (a free) settles
    nothing nested, and what it defers in turn runs right after it, before the work queued
    behind it, as had it been done at once."""

    __slots__ = ("_work", "_running", "_internal_error")

    def __init__(self, internal_error: Callable[[str], None]) -> None:
        self._work: deque[Callable[[], object]] = deque()
        self._running = False
        self._internal_error = internal_error  # a failure is counted and confined to its piece

    def __bool__(self) -> bool:
        return bool(self._work) and not self._running

    def add(self, work: Callable[[], object]) -> None:
        self._work.append(work)

    def run(self, limit: int | None = None) -> None:
        """Do the work queued, in order; with a `limit`, that many pieces at most (a transport
        lets its other clients in between pieces of a huge booking's work)."""
        if self._running or not self._work:
            return
        self._running = True
        left = limit
        try:
            while self._work and (left is None or left > 0):
                if left is not None:
                    left -= 1
                job = self._work.popleft()
                rest, self._work = self._work, deque()
                try:
                    job()
                except Exception:  # noqa: BLE001 - one piece's failure is confined to it
                    self._internal_error("deferred")
                self._work.extend(rest)  # behind what `job` deferred
        finally:
            self._running = False
