"""Start warm from a peer (`--indexer-peers`): before the port opens, each peer's `/dump` is
fetched in order (each within `timeout` seconds) and the first that restores is kept; when none
does, the service starts empty, with a warning."""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio

from ..adapters.fetch import FetchError
from ..core.base import jsonio
from ..core.base.errors import SelectionError
from ..core.service import SelectionService
from .logs import log
from .pump import http_get

__all__ = ["recover_from_peers"]


async def recover_from_peers(service: SelectionService, peers: Sequence[str], timeout: float = 10.0
                             ) -> str | None:
    """The peer the service was restored from, or None."""
    for url in peers:
        try:
            with anyio.fail_after(timeout):
                body = await http_get(url.rstrip("/") + "/dump", service.settings.max_state_bytes)
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
