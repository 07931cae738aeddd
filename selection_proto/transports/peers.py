"""Start warm from a peer (`--indexer-peers`): before the port opens, each peer's `/dump` is
fetched in order (each within `timeout` seconds) and the first that restores is kept; when none
does, the service starts empty, with a warning."""

from __future__ import annotations

import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import anyio

from ..adapters.fetch import Fetch, FetchError
from ..core import jsonio
from ..core.errors import SelectionError
from ..core.service import SelectionService
from .logs import log
from .pump import flush, receive

__all__ = ["recover_from_peers"]


async def _get(url: str, limit: int) -> bytes:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise FetchError("expected an http://host:port URL")
    fetch = Fetch(parts.netloc, (parts.path.rstrip("/") or "") + "/dump", limit)
    async with await anyio.connect_tcp(parts.hostname, parts.port or 80) as stream:
        await flush(stream.send, fetch)
        while not fetch.done:
            data = await receive(stream)
            fetch.receive_data(data or b"")
    return fetch.body


async def recover_from_peers(service: SelectionService, peers: Sequence[str], timeout: float = 10.0
                             ) -> str | None:
    """The peer the service was restored from, or None."""
    for url in peers:
        try:
            with anyio.fail_after(timeout):
                body = await _get(url, service.settings.max_state_bytes)
            with jsonio.gc_paused():
                value = jsonio.loads(body)
            service.recover(value, url, now=time.monotonic())
        except (OSError, TimeoutError, FetchError, jsonio.JSONSyntaxError, SelectionError) as exc:
            detail = exc.message if isinstance(exc, SelectionError) else str(exc) or type(exc).__name__
            log("warning", "peer_recovery_failed", peer=url, detail=detail)
            continue
        log("info", "recovered_from_peer", peer=url)
        return url
    log("warning", "no_reachable_peers", detail="starting with empty state")
    return None
