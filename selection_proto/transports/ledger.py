"""The booking ledger on Valkey/Redis (docs/REPLICATION.md): the one module that talks to it.

Three loops share one `Ledger` mirror, all on the event loop, through redis-py (`_Client`):

- the writer takes a snapshot when the mirror asks for one, writes the journal in batches through
  one script call, and runs the reaper (leases on the server's clock) about once a second;
- the reader follows the feed with `XREAD BLOCK` on a connection of its own;
- the supervisor reconnects with backoff and tells the core when the ledger is reachable.

Every key of a scope shares one hash tag, `sp:{scope}:…`, so each script touches one slot."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final

import anyio

from ..core.base.metrics import LEDGER_EVENTS, LEDGER_FEED_LAG, LEDGER_FLUSH
from ..core.fleet.ledger_wire import LedgerWireError, decode_replies, decode_snapshot
from ..core.ledger import Ledger
from ..core.service import SelectionService
from .ledger_scripts import SCRIPTS
from .logs import log

__all__ = ["LedgerLink", "SettingsRefused", "open_client", "registry_peers"]

BACKOFF_START: Final = 0.05
BACKOFF_MAX: Final = 1.0  # well under the free grace: a booking held by an outage still lands in it
READ_BLOCK_MS: Final = 1000  # a reader's wait for new entries; also how late it notices a cancel
READ_COUNT: Final = 1000
REAP_INTERVAL_SECS: Final = 1.0
REAP_LIMIT: Final = 1000
SOCKET_TIMEOUT_SECS: Final = 5.0
_KEYS: Final = ("res", "pre", "out", "deadline", "tomb", "adds", "workers", "epoch", "seq", "feed", "last",
                 "replicas", "owner", "gone", "fence", "wait")
REPLICA_FRESH_SECS: Final = 10.0  # a registered replica not seen for longer is not asked for /dump
REPLICA_FORGET_SECS: Final = 300.0  # and is removed from the registry

def open_client(url: str, timeout: float = SOCKET_TIMEOUT_SECS) -> Any:
    """A redis-py client for `redis://`, `rediss://` or `unix://` URLs (its URL rules)."""
    try:
        import redis
    except ImportError:
        raise RuntimeError("--ledger needs the redis package: pip install 'selection-proto[ledger]'") from None
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                decode_responses=False, health_check_interval=0)


class LedgerLink:
    """Keeps one service's `Ledger` in step with the shared ledger at `url`."""

    def __init__(self, service: SelectionService, ledger: Ledger, url: str, scope: str, *,
                 lease_secs: float, batch: int = 64, feed_max: int = 1_000_000,
                 on_change: Callable[[], Awaitable[None]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.ledger = ledger
        self.url = url
        self.scope = scope
        self.keys = [f"sp:{{{scope}}}:{name}" for name in _KEYS]
        self.feed = self.keys[9]
        self.lease_ms = max(1, int(lease_secs * 1000)) if math.isfinite(lease_secs) else 1 << 50
        self.batch = batch
        self.feed_max = feed_max
        self.on_change = on_change
        self.clock = clock
        self.wake = anyio.Event()
        self.snapshot_loaded = anyio.Event()
        self.epoch = ""
        self.advertise: str | None = None  # this replica's URL for peers' /dump, in the registry
        self.held_writes = False  # a test's hand on the writer: ops stay queued while True
        self.held_reads = False  # and on the reader: the feed is not read while True
        self.parked = False  # the reader is waiting for held_reads to clear
        self.writing = False  # a batch is on its way: taken from the journal, not yet answered
        settings = service.settings
        # Settings the shared state depends on (docs/REPLICATION.md): replicas that differ in
        # them would drift apart (a booking aged out on one, a worker refused by one's limits), so
        # a replica whose differ from a live one's refuses to join.
        self.binding = {"lease_ms": self.lease_ms, **{name: getattr(settings, name) for name in (
            "track_active_blocks", "max_keys", "max_workers_per_key", "max_dp_size", "max_tombstones")}}
        # Settings that change only this replica's own answers: a difference is named and counted.
        self.shared = {**self.binding, "feed_max": feed_max, **{name: getattr(settings, name) for name in (
            "kv_events", "max_reservations_per_key", "router_policy")}}
        self.differing: set[bytes] = set()  # replicas already warned about
        self.joined = False  # admitted by the registry once: later reconnects are not checked again
        self.refused: str | None = None  # why this replica refused to join, when it did

    def poke(self) -> None:
        """Something may be queued for the ledger: let the writer look."""
        if self.ledger.journal.ops or self.ledger.needs_snapshot:
            self.wake.set()

    async def settle(self, timeout: float) -> None:
        """Wait (at most `timeout`) until what is queued is written, while the ledger is reachable."""
        journal = self.ledger.journal
        with anyio.move_on_after(timeout):
            while (journal.ops or self.writing) and journal.connected:
                self.wake.set()
                await anyio.sleep(0.005)

    async def _changed(self) -> None:
        if self.on_change is not None:
            await self.on_change()

    async def run(self) -> None:
        """Until cancelled: connect, sync, follow; on any failure, tell the core and retry."""
        delay = BACKOFF_START
        failures = 0
        while True:
            started = self.clock()
            try:
                await self._session()
            except SettingsRefused as exc:
                self.refused = str(exc)
                log("error", "ledger_settings_refused", detail=self.refused)
                raise
            except Exception as exc:  # noqa: BLE001 - every failure of the ledger is a reconnect
                failures = 1 if self.clock() - started > 10 * BACKOFF_MAX else failures + 1
                # The first failure of an outage is a warning; its retries are debug lines.
                log("warning" if failures == 1 else "debug", "ledger_unavailable", url=_redacted(self.url),
                    detail=_reason(exc), retry_in_secs=delay)
            self.ledger.connected(False, self.clock())
            self.ledger.tick(self.clock())  # a free held across the outage answers 503 after its grace
            await self._changed()
            if self.clock() - started > 10 * BACKOFF_MAX:
                delay = BACKOFF_START  # it was up a while: this is a new outage
            await anyio.sleep(delay)
            delay = min(BACKOFF_MAX, delay * 2)

    async def _session(self) -> None:
        writer, reader = _Client(self.url), _Client(self.url, SOCKET_TIMEOUT_SECS + READ_BLOCK_MS / 1000)
        try:
            await self._init(writer)
            if not self.joined:
                await self._join(writer)
            self.ledger.connected(True, self.clock())
            log("info", "ledger_connected", url=_redacted(self.url), origin=self.ledger.origin)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read, reader)
                await self._write(writer)
        finally:
            with anyio.CancelScope(shield=True):
                await writer.close()
                await reader.close()

    async def _init(self, writer: _Client) -> None:
        fresh = self.ledger.origin + ":" + str(time.time_ns())
        epoch = (await writer.script("init", self.keys, [fresh])).decode()
        if self.ledger.epoch is not None and epoch != self.ledger.epoch:
            log("warning", "ledger_reset", detail="the ledger's epoch changed: giving it our own state again")
            self.ledger.reseed()
        self.epoch = epoch

    async def _write(self, writer: _Client) -> None:
        ledger, journal = self.ledger, self.ledger.journal
        next_reap = self.clock()
        while True:
            if ledger.needs_snapshot:
                raw = await writer.script("snapshot", self.keys, [ledger.n])
                ledger.load(decode_snapshot(raw), self.clock())
                self.snapshot_loaded.set()
                await self._changed()
            if journal.ops and not self.held_writes:
                await self._flush(writer)
                continue
            if self.clock() >= next_reap:
                reaped = await writer.script("reap", self.keys, [self.epoch, ledger.origin, REAP_LIMIT,
                                                                 self.lease_ms, self.feed_max])
                if reaped == -1:  # emptied under a live connection (FLUSHALL): noticed within a second
                    ledger.reseed()
                    await self._init(writer)
                    continue
                await self._register(writer)
                next_reap = self.clock() + REAP_INTERVAL_SECS
            ledger.tick(self.clock())
            await self._changed()
            due = min(next_reap, ledger.next_deadline() or math.inf)
            with anyio.move_on_after(max(0.0, due - self.clock())):
                await self.wake.wait()
            self.wake = anyio.Event()

    async def _flush(self, writer: _Client) -> None:
        journal = self.ledger.journal
        ops = journal.take(self.batch)
        # A free that came before its booking is remembered as long as the freeing replica holds
        # its answer, no longer: the memory starts on the server before the hold starts here, so
        # it always ends first, and a booking it refused was always answered 200 to the free.
        tombstone_ms = int(self.ledger.settings.free_grace_secs * 1000)
        args: list[Any] = [self.epoch, self.ledger.origin, self.lease_ms, tombstone_ms, self.feed_max]
        for op in ops:
            args += (op.kind, op.ident, op.body, op.rank_key or op.owner, "" if op.count is None else op.count,
                     op.view)
        started = self.clock()
        self.writing = True
        try:
            raw = await writer.script("batch", self.keys, args)
            replies = decode_replies(raw, len(ops))
        except BaseException:
            journal.requeue(ops)  # written or not, the ops are idempotent: they go again
            raise
        finally:
            self.writing = False
        self.service.observe(LEDGER_FLUSH, (), self.clock() - started)
        if replies is None:
            journal.requeue(ops)
            self.ledger.reseed()
            await self._init(writer)
            return
        self.ledger.results(ops, replies, self.clock())
        await self._changed()

    def _record(self) -> str:
        binding = json.dumps(self.binding, sort_keys=True, separators=(",", ":"))
        return json.dumps({"url": self.advertise, "seen": time.time(), "settings": self.shared, "binding": binding})

    async def _join(self, writer: _Client) -> None:
        """Register, unless a live replica of the scope differs in a setting the shared state
        depends on: then refuse, naming them (`SettingsRefused`)."""
        record = self._record()
        found = await writer.script("join", self.keys, [self.ledger.origin, record, json.loads(record)["binding"],
                                                        time.time(), REPLICA_FRESH_SECS])
        if found:
            theirs = json.loads(found[1])
            differ = ", ".join(f"{name}={self.binding.get(name)!r} (theirs {theirs.get(name)!r})"
                               for name in sorted(self.binding.keys() | theirs.keys())
                               if self.binding.get(name) != theirs.get(name))
            raise SettingsRefused(f"refusing to join ledger scope {self.scope}: "
                                  f"settings differ from replica {found[0].decode('utf-8', 'replace')}: {differ}")
        self.joined = True

    async def _register(self, writer: _Client) -> None:
        """Say where this replica answers (for a starting peer's /dump) and with which shared
        settings; warn of a replica whose differ; forget long-gone ones."""
        registry, now = self.keys[11], time.time()
        await writer.call("hset", registry, self.ledger.origin, self._record())
        entries = await writer.call("hgetall", registry)
        gone = [origin for origin, seen in _registered(entries) if now - seen > REPLICA_FORGET_SECS]
        if gone:
            await writer.call("hdel", registry, *gone)
        for origin, raw in entries.items():
            if origin in gone or origin in self.differing:
                continue
            try:
                theirs = json.loads(raw).get("settings")
            except (ValueError, AttributeError):
                continue
            if isinstance(theirs, dict) and theirs != self.shared:
                self.differing.add(origin)
                self.service.observe(LEDGER_EVENTS, ("settings_differ",), 1.0)
                log("warning", "ledger_settings_differ", replica=origin.decode("utf-8", "replace"),
                    differ=sorted(k for k in self.shared.keys() | theirs.keys()
                                  if self.shared.get(k) != theirs.get(k)))

    async def unregister(self) -> None:
        """A clean stop: peers stop asking this replica at once."""
        if self.advertise is None:
            return
        client = _Client(self.url, 1.0)
        try:
            await client.call("hdel", self.keys[11], self.ledger.origin)
        except Exception:  # noqa: BLE001, S110 - the registry forgets it after REPLICA_FORGET_SECS anyway
            pass
        finally:
            await client.close()

    async def _read(self, reader: _Client) -> None:
        ledger = self.ledger
        while True:
            if ledger.needs_snapshot:
                self.wake.set()
                self.snapshot_loaded = anyio.Event()
                await self.snapshot_loaded.wait()
            while self.held_reads:
                self.parked = True
                await anyio.sleep(0.005)
            self.parked = False
            found = await reader.call("xread", {self.feed: ledger.cursor}, count=READ_COUNT, block=READ_BLOCK_MS)
            if found:
                entries = found[0][1]
                ledger.apply(entries, self.clock())
                millis, _, _ = entries[-1][0].partition(b"-")  # an entry id is the ledger's ms, then a count
                if millis.isdigit():
                    self.service.observe(LEDGER_FEED_LAG, (), max(0.0, time.time() - int(millis) / 1000))
                await self._changed()


class SettingsRefused(RuntimeError):
    """A live replica of the scope differs in a setting the shared state depends on."""


def _registered(entries: dict[bytes, bytes]) -> list[tuple[bytes, float]]:
    """(origin, last seen) of each readable registry entry; an entry that does not read is old."""
    out = []
    for origin, raw in entries.items():
        try:
            seen = json.loads(raw)["seen"]
        except (ValueError, KeyError, TypeError):
            seen = 0.0
        out.append((origin, seen if isinstance(seen, (int, float)) else 0.0))
    return out


def registry_peers(url: str, scope: str, timeout: float = 2.0) -> list[str]:
    """The URLs of replicas seen lately in the scope's registry, most recent first (empty when
    the ledger cannot be read: a start then goes on without a peer)."""
    client = open_client(url, timeout)
    try:
        entries = client.hgetall(f"sp:{{{scope}}}:replicas")
    except Exception as exc:  # noqa: BLE001 - no ledger yet: nothing to warm from
        log("warning", "registry_unreadable", url=_redacted(url), detail=_reason(exc))
        return []
    finally:
        client.close()
    now, found = time.time(), []
    for _, raw in entries.items():
        try:
            record = json.loads(raw)
            if now - record["seen"] <= REPLICA_FRESH_SECS and isinstance(record["url"], str):
                found.append((record["seen"], record["url"]))
        except (ValueError, KeyError, TypeError):
            continue
    return [peer for _, peer in sorted(found, reverse=True)]


def _on_asyncio() -> bool:
    """Whether anyio runs on asyncio here (trio runs no asyncio loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True




class _Client:
    """One connection's worth of redis-py, as the event loop allows: its asyncio client under
    asyncio, its blocking client in worker threads under trio (redis-py has no trio client).
    A thread hop costs about 110 µs here; a script call over a unix socket about 30."""

    def __init__(self, url: str, timeout: float = SOCKET_TIMEOUT_SECS) -> None:
        self.native = _on_asyncio()
        if self.native:
            import redis.asyncio

            self.redis: Any = redis.asyncio.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=0)
        else:
            self.redis = open_client(url, timeout)
        self.scripts = {name: self.redis.register_script(text) for name, text in SCRIPTS.items()}

    async def script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        if self.native:
            return await self.scripts[name](keys=keys, args=args)
        return await anyio.to_thread.run_sync(partial(self.scripts[name], keys=keys, args=args),
                                              abandon_on_cancel=True)

    async def call(self, command: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.redis, command)
        if self.native:
            return await method(*args, **kwargs)
        return await anyio.to_thread.run_sync(partial(method, *args, **kwargs), abandon_on_cancel=True)

    async def close(self) -> None:
        if self.native:
            await self.redis.aclose()
        else:
            self.redis.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_reason(e) for e in exc.exceptions)
    if isinstance(exc, LedgerWireError):
        return f"unexpected answer: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _redacted(url: str) -> str:
    """The URL without its password, for logs."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{'***@' if at else ''}{host}" if sep else url
