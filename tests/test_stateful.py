"""The whole-core state machine of fuzz/machine.py, bounded by the active Hypothesis profile."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuzz.machine import ServiceMachine  # noqa: E402

TestServiceMachine = ServiceMachine.TestCase
