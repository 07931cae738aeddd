"""The serving process's own figures for `/metrics` (resident memory, CPU time, open descriptors,
start time), read from the operating system by the transport and reported through
`SelectionService.observe`; the core reads no clock and no `/proc`."""

from __future__ import annotations

import os
import time

from ..core.base.metrics import PROCESS_CPU, PROCESS_FDS, PROCESS_MEMORY, PROCESS_START
from ..core.service import SelectionService

__all__ = ["ProcessMetrics"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class ProcessMetrics:
    """Reports the figures that changed since the last report (CPU time as the seconds spent since)."""

    def __init__(self, service: SelectionService) -> None:
        self._service = service
        self._cpu = 0.0
        # The process's start, in wall-clock seconds: now, minus how long it has been running.
        service.observe(PROCESS_START, (), time.time() - (time.monotonic() - _started_monotonic()))

    def report(self) -> None:
        cpu = time.process_time()
        self._service.observe(PROCESS_CPU, (), max(0.0, cpu - self._cpu))
        self._cpu = cpu
        try:
            with open("/proc/self/statm", "rb") as fh:
                self._service.observe(PROCESS_MEMORY, (), float(int(fh.read().split()[1]) * _PAGE))
            self._service.observe(PROCESS_FDS, (), float(len(os.listdir("/proc/self/fd"))))
        except (OSError, ValueError, IndexError):
            pass  # not Linux: these two are simply not reported


def _started_monotonic() -> float:
    try:
        with open("/proc/self/stat", "rb") as fh:
            ticks = int(fh.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as fh:
            uptime = float(fh.read().split()[0])
        return time.monotonic() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic()
