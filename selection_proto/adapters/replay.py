"""Engine replay as a Sans-IO sequence (docs/DECISIONS.md): vLLM and SGLang number their ZMQ batches and keep
the recent ones behind a ROUTER socket (the worker's `replay_endpoint`). When the live stream skips
a number (also when a new subscription's first batch is not 0), the missing batches are asked for
(`want`), the live ones that keep arriving are held, and everything is handed on in order, each
number once (`ready`). Numbers the engine no longer has are counted as unrecovered and the next
batch is handed on anyway: the core sees the jump, counts the gap and marks the rank stale.

A live number below the expected one is the live copy of a batch a replay brought only when it lies
in the replayed range; any other is an engine that restarted (its numbers begin again at 0, issue
34): it is handed on, so that the core drops the rank's index, and what the new engine published
before it is asked for from 0.

A replay from 0 (a new subscription, or an engine that restarted) brings the engine's whole
retained history (vLLM keeps its last 10,000 batches): the index needs all of it, since the blocks
an engine has held longest, its most reused, were stored first and are never published again
while it keeps them; but nothing before the engine's newest `AllBlocksCleared`, which empties what
came before: those batches are passed over (docs/GATEWAY.md, "Replay at start")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from ..core.cache.engine import InvalidBatch, decode_batch

__all__ = ["MAX_HELD", "SeqOrder", "newest_clear", "parse_replay_frames", "replay_holes", "replay_request"]

MAX_HELD: Final = 10_000  # live batches held during one replay (vLLM keeps 10,000 by default)
END: Final = -1
CLEARED: Final = "AllBlocksCleared"


def replay_holes(seqs: Sequence[int], ended: bool) -> int | None:
    """Where to ask again after a replay brought the sorted numbers `seqs`: the first one missing
    between two it brought (an engine keeps consecutive numbers, so only the wire lost it), or the
    one after the last when the end marker was lost too; None when nothing is missing."""
    for before, after in zip(seqs, seqs[1:], strict=False):
        if after != before + 1:
            return before + 1
    if seqs and not ended:
        return seqs[-1] + 1
    return None


def newest_clear(batches: Sequence[tuple[int, bytes]]) -> int:
    """The position of the newest batch that holds an `AllBlocksCleared` (0 when none does). Only
    batches whose bytes contain the tag's name are decoded, newest first."""
    tag = CLEARED.encode()
    for position in range(len(batches) - 1, 0, -1):
        payload = batches[position][1]
        if tag in payload:
            try:
                if any(event.tag == CLEARED for event in decode_batch(payload).events):
                    return position
            except InvalidBatch:
                continue  # the core counts it when it is applied
    return 0


def replay_request(start: int) -> list[bytes]:
    """What a DEALER sends to ask for every batch from `start` on (an empty delimiter frame, as
    a REQ socket would add, then the 8-byte big-endian number)."""
    return [b"", start.to_bytes(8, "big")]


def parse_replay_frames(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replayed batch, `(END, b"")` at the end; None when malformed. vLLM
    sends `[b"", seq, payload]`, newer versions `[b"", topic, seq, payload]`."""
    if len(frames) == 3:
        _, seq, payload = frames
    elif len(frames) == 4:
        _, _, seq, payload = frames
    else:
        return None
    if len(seq) != 8:
        return None
    return int.from_bytes(seq, "big", signed=True), payload


class SeqOrder:
    """One subscription's batches, put back in order with the engine's help."""

    __slots__ = ("next", "replaying", "want", "_held", "_ready", "requested", "recovered", "unrecovered",
                 "overflowed", "restarts", "passed_over", "_replayed")

    def __init__(self) -> None:
        self.next: int | None = None  # the number the index expects next
        self.replaying = False
        self.want: int | None = None  # a replay to request from this number (the transport clears it)
        self._held: dict[int, bytes] = {}
        self._ready: list[tuple[int, bytes]] = []
        self.requested = self.recovered = self.unrecovered = self.overflowed = self.restarts = 0
        self.passed_over = 0  # replayed batches before the engine's newest clear
        self._replayed = range(0)  # numbers the last replay handed on: their live copies may follow

    def ready(self) -> list[tuple[int, bytes]]:
        """The batches to apply now, in order."""
        out, self._ready = self._ready, []
        return out

    def live(self, seq: int, payload: bytes, can_replay: bool = True) -> None:
        """A batch from the live stream."""
        expected = 0 if self.next is None else self.next
        if seq < expected:
            if seq in self._replayed:
                return  # already applied (a replay brought it first)
            self.restarts += 1  # the engine started again: its numbers did
            self.next, expected = None, 0
            self._held.clear()
        elif seq == expected and not self.replaying:
            self._replayed = range(0)  # the live stream caught up: no copy is left to come
        if self.replaying or (seq > expected and can_replay):
            if len(self._held) >= MAX_HELD:
                self.overflowed += 1  # dropped: the stream will show the gap
            else:
                self._held[seq] = payload
            if not self.replaying:
                self.replaying = True
                self.want = expected
                self._replayed = range(expected, expected)  # its start; its end when it is done
                self.requested += 1
            return
        self._hand_on(seq, payload)

    def replay(self, batches: Sequence[tuple[int, bytes]]) -> None:
        """Every batch one replay brought, in the engine's order. When nothing was handed on yet
        (a new subscription, an engine that restarted), what precedes the newest clear is passed
        over; after a gap in a running stream every batch is handed on, so that the core's count
        of what was lost stays exact."""
        skip = newest_clear(batches) if self.next is None else 0
        for seq, _ in batches[:skip]:
            if seq >= (0 if self.next is None else self.next):
                self._held.pop(seq, None)
                self.passed_over += 1
                self.next = seq + 1  # not handed on: the core's first batch is the clear's
        for seq, payload in batches[skip:]:
            self.replayed(seq, payload)

    def replayed(self, seq: int, payload: bytes) -> None:
        """A batch the engine replayed."""
        expected = 0 if self.next is None else self.next
        if seq < expected:
            return
        self._held.pop(seq, None)
        if seq > expected:
            self.unrecovered += seq - expected  # evicted from the engine's buffer
        else:
            self.recovered += 1
        self._hand_on(seq, payload)

    def replay_done(self) -> None:
        """The engine ended its replay (or did not answer): hand on what was held, in order."""
        self.replaying = False
        self.want = None
        for seq in sorted(self._held):
            expected = 0 if self.next is None else self.next
            if seq < expected:
                continue
            if seq > expected:
                self.unrecovered += seq - expected
            self._hand_on(seq, self._held[seq])
        self._held.clear()
        if self.next is not None:
            self._replayed = range(self._replayed.start, self.next)

    def _hand_on(self, seq: int, payload: bytes) -> None:
        self._ready.append((seq, payload))
        self.next = seq + 1
