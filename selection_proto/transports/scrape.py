"""Engines' own metrics (docs/VERDICT.md): every `interval` seconds each schedulable worker's
`metrics_endpoint` is fetched (a few at once, each within `TIMEOUT` seconds and `MAX_BYTES`), read in
a worker thread (`core.cache.engine_metrics.parse`) and handed to the service, which shows it in `/loads`.
A slow or silent engine costs its own scrape, never the event loop."""

from __future__ import annotations

import time

import anyio

from ..adapters.fetch import FetchError
from ..core.cache.engine_metrics import parse
from ..core.service import SelectionService
from .pump import http_get

__all__ = ["CONCURRENCY", "MAX_BYTES", "TIMEOUT", "scrape_engines"]

TIMEOUT = 2.0
MAX_BYTES = 1 << 20  # a vLLM exposition is ~20 KB
CONCURRENCY = 8


async def scrape_engines(service: SelectionService, interval: float) -> None:
    """Scrape every `metrics_endpoint`, then wait `interval` seconds, until cancelled."""
    limiter = anyio.CapacityLimiter(CONCURRENCY)
    while True:
        targets = service.catalog.metrics_endpoints()
        if targets:
            async with anyio.create_task_group() as tg:
                for worker_id, url in targets:
                    tg.start_soon(_scrape, service, limiter, worker_id, url)
        await anyio.sleep(interval)


async def _scrape(service: SelectionService, limiter: anyio.CapacityLimiter, worker_id: int, url: str) -> None:
    async with limiter:
        try:
            with anyio.fail_after(TIMEOUT):
                body = await http_get(url, MAX_BYTES)
            sample, error = await anyio.to_thread.run_sync(parse, body), None
        except TimeoutError:
            sample, error = None, f"no answer within {TIMEOUT:g} s"
        except (OSError, FetchError) as exc:
            sample, error = None, str(exc) or type(exc).__name__
        service.engine_scraped(worker_id, sample, error, now=time.monotonic())  # serve's clock
