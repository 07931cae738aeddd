"""What a batch of KV events did, counted once (events.md §7.4): applied, failed with the first
100 failures and their positions, dropped; and the `ApplyReport` it makes."""

from __future__ import annotations

from typing import Final

from ..base.responses import ApplyReport

__all__ = ["MAX_FAILURES", "Tally"]

MAX_FAILURES: Final = 100


class Tally:
    __slots__ = ("received", "applied", "failed", "dropped", "failures")

    def __init__(self, received: int) -> None:
        self.received = received
        self.applied = 0
        self.failed = 0
        self.dropped = 0
        self.failures: list[tuple[int, str]] = []

    def fail(self, index: int, text: str) -> None:
        """The event at `index` of the batch failed with `text`; failures come in index order."""
        self.failed += 1
        if len(self.failures) < MAX_FAILURES:
            self.failures.append((index, text))

    def report(self) -> ApplyReport:
        return ApplyReport(received=self.received, applied=self.applied, failed=self.failed,
                           dropped=self.dropped, failures=tuple(self.failures))
