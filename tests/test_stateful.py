"""The whole-core state machine of fuzz/machine.py, bounded by the active Hypothesis profile."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuzz.machine import ServiceMachine  # noqa: E402

TestServiceMachine = ServiceMachine.TestCase


def test_a_booking_that_expires_on_a_select_is_not_counted_live() -> None:
    """Pinned from a long run: a booking 300 s old (the expiry) outlived a tick by a rounding, then
    expired on the next booking's call; the machine now forgets bookings that expire on any call."""
    machine = ServiceMachine()
    machine.start(seed=0, queueing=False, policy="dynamo")
    machine.garbage(path="/select", raw=b"")  # each call moves the clock 0.01 s: the exact sum matters
    machine.garbage(path="/select", raw=b"")
    machine.tick(129.38530764472446)
    machine.upsert(bs=2, dp=1, wid=1)
    machine.tick(83.0)
    machine.select(flow={}, pin=None, reserve=True, tokens=[])
    machine.tick(300.0)
    machine.select(flow={}, pin=None, reserve=True, tokens=[])
    machine.loads_are_consistent()
    machine.teardown()
