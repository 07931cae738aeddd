"""Snapshots of one instance (`--snapshot PATH`): the `/dump` document, written atomically (a
temporary file beside PATH, fsync, rename) every `--snapshot-interval-secs` and at shutdown, and
read back at start by the command line (`cli._restore`); and `GET /dump` answered the same way.

A periodic snapshot is written by a forked child from its copy of the process's memory, as Redis's
BGSAVE does: the event loop only pays for the fork (page tables, milliseconds), never for the dump
itself, which takes seconds for a million indexed blocks. Where `os.fork` does not exist the dump
runs on the loop with the collector paused."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import anyio

from ..adapters.http import LargeRequest
from ..core.base import jsonio
from ..core.base.metrics import SNAPSHOT_LAST_SUCCESS, SNAPSHOTS
from ..core.base.wire import Response, error_response
from ..core.service import SelectionService
from .logs import log

__all__ = ["Snapshots", "dump_in_child", "fork_child", "write_snapshot"]

_MAX_FD = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536


def write_snapshot(service: SelectionService, path: str) -> int:
    """Write the service's dump to `path` atomically; returns its size in bytes."""
    with jsonio.gc_paused():
        data = jsonio.dumps(service.dump())
    folder = os.path.dirname(os.path.abspath(path))
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    try:  # the rename itself survives a power loss once the folder is synced
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return len(data)
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
    return len(data)


def fork_child(work: Callable[[int], None]) -> tuple[int, int]:
    """Run `work(says)` in a forked child, from its copy of this process's memory, and return
    (its pid, the read end of the pipe `says` it writes to). The child closes every other
    descriptor first (the parent's sockets must not outlive the parent's close of them) and
    leaves without running the parent's exit handlers. Raises OSError when it cannot fork."""
    reads, says = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(reads)
        os.close(says)
        raise
    if pid == 0:  # pragma: no cover - the child's lines are not traced (it leaves by os._exit)
        code = 1
        try:
            os.closerange(3, says)
            os.closerange(says + 1, _MAX_FD)
            work(says)
            code = 0
        except BaseException as exc:  # noqa: BLE001 - the parent reads what went wrong
            try:
                os.write(says, f"{type(exc).__name__}: {exc}".encode()[:4096])
            except OSError:
                pass
        finally:
            os._exit(code)
    os.close(says)
    return pid, reads


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def dump_in_child(service: SelectionService, request: LargeRequest, clock: Callable[[], float]) -> Response:
    """`GET /dump`, written by a forked child from its copy of memory (as the periodic snapshot
    is) and read back in a worker thread: a million blocks take seconds to encode, which would
    hold every other client. Where it cannot fork, answered here."""
    method, path, query, headers, body, _ = request

    def answer() -> Response:
        result = service.handle(method, path, query, headers, body, now=clock())
        assert isinstance(result, Response)  # a read: never queued, never held for the ledger
        return result

    def child(says: int) -> None:  # pragma: no cover - in the forked child
        status, fields, payload = answer()
        write_all(says, jsonio.dumps([status, fields]) + b"\n")
        write_all(says, payload)

    try:
        pid, reads = fork_child(child)
    except OSError:
        return answer()
    status, raw = await anyio.to_thread.run_sync(_collect, pid, reads)
    head, _, payload = raw.partition(b"\n")
    if status != 0 or not head.startswith(b"["):
        service.internal_error("dump")
        return error_response(500, "internal error")
    code, fields = jsonio.loads(head)
    return Response(code, tuple((n, v) for n, v in fields), payload)


def _collect(pid: int, reads: int) -> tuple[int, bytes]:
    """Everything a forked child wrote, and its exit code (in a worker thread: it blocks)."""
    chunks = []
    with os.fdopen(reads, "rb", buffering=0) as pipe:
        while chunk := pipe.read(1 << 20):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks)


class Snapshots:
    """The periodic snapshot: `tick` (from the server's timer, at least once a second) reaps a
    finished child and forks the next when one is due; `final` writes the last one at shutdown."""

    def __init__(self, service: SelectionService, path: str, interval_secs: float) -> None:
        self._service = service
        self.path = path
        self.interval_secs = interval_secs  # 0: only at shutdown
        self._child: int | None = None
        self._child_says = -1  # the read end of the pipe the child reports on: its seconds, or why it failed
        self._due = time.monotonic() + interval_secs

    def tick(self) -> None:
        if self._child is not None:
            self._reap(block=False)
        if self._child is None and self.interval_secs > 0 and time.monotonic() >= self._due:
            self._due = time.monotonic() + self.interval_secs
            self._start()

    def final(self) -> None:
        """The snapshot at shutdown, on this thread: the loop has nothing left to serve."""
        if self._child is not None:
            self._reap(block=True)
        started = time.monotonic()
        try:
            size = write_snapshot(self._service, self.path)
        except Exception as exc:  # noqa: BLE001 - reported; shutting down goes on
            self._failed(f"{type(exc).__name__}: {exc}")
            return
        self._written(time.monotonic() - started, size)

    def _start(self) -> None:
        if not hasattr(os, "fork"):  # pragma: no cover - not on Linux or macOS
            self.final()
            return
        try:
            self._child, self._child_says = fork_child(self._child_main)
        except OSError as exc:
            self._failed(f"fork: {exc.strerror or exc}")

    def _child_main(self, says: int) -> None:  # pragma: no cover - in the forked child
        """Write the snapshot, and report its seconds on `says`."""
        started = time.monotonic()
        write_snapshot(self._service, self.path)
        os.write(says, f"{time.monotonic() - started:.3f}".encode())

    def _reap(self, *, block: bool) -> None:
        assert self._child is not None
        try:
            pid, status = os.waitpid(self._child, 0 if block else os.WNOHANG)
        except ChildProcessError:
            pid, status = self._child, 1 << 8
        if pid == 0:
            return  # still writing
        self._child = None
        with os.fdopen(self._child_says, "rb") as pipe:  # the child has ended: this cannot block
            said = pipe.read().decode(errors="replace")
        code = os.waitstatus_to_exitcode(status)
        if code == 0:
            self._written(float(said or 0.0), os.path.getsize(self.path))
        else:
            self._failed(said or f"the snapshot process ended with {code}")

    def _written(self, seconds: float, size: int) -> None:
        self._service.observe(SNAPSHOTS, ("ok",), 1.0)
        self._service.observe(SNAPSHOT_LAST_SUCCESS, (), time.time())
        log("info", "snapshot written", path=self.path, bytes=size, seconds=round(seconds, 3))

    def _failed(self, error: str) -> None:
        self._service.observe(SNAPSHOTS, ("failed",), 1.0)
        log("error", "snapshot failed", path=self.path, error=error)
