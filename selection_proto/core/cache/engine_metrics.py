"""An engine's own metrics (docs/VERDICT.md): what a worker's `metrics_endpoint` reports, read from the
Prometheus text vLLM and SGLang serve (running and waiting requests, KV cache usage, prefix-cache
hits and queries), kept as the latest sample per worker and shown in `/loads`.

The transport scrapes; this module only reads the text it got (`parse`, pure, for a worker thread)
and keeps what it read (`EngineMetrics`). A sample is a handful of numbers: memory stays bounded by
the number of workers whatever an endpoint sends."""

from __future__ import annotations

import math
import re
from typing import Any, Final

__all__ = ["ENGINE_METRICS", "MAX_WORKERS", "EngineMetrics", "EngineSample", "parse"]

# Our name -> the engines' names for it, summed over label sets (several models or DP ranks).
ENGINE_METRICS: Final[dict[str, tuple[str, ...]]] = {
    "running_requests": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting_requests": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"),
    "prefix_cache_hit_rate": ("sglang:cache_hit_rate",),
}
_OURS: Final = {theirs: ours for ours, names in ENGINE_METRICS.items() for theirs in names}
# `name{labels} value [timestamp]`: labels may hold any quoted text, braces included.
_SAMPLE: Final = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)')
MAX_WORKERS: Final = 65_536
_AVERAGED: Final = ("kv_usage", "prefix_cache_hit_rate")  # shares: the mean over label sets, not the sum


class EngineSample(dict[str, float]):
    """Our names -> values read from one scrape."""


def parse(text: bytes) -> EngineSample:
    """The metrics of ENGINE_METRICS found in a Prometheus text exposition; what is not there, or
    not a finite number, is left out."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.decode("utf-8", "replace").splitlines():
        if not line or line[0] == "#":
            continue
        match = _SAMPLE.match(line)
        if match is None or match.group(1) not in _OURS:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        ours = _OURS[match.group(1)]
        sums[ours] = sums.get(ours, 0.0) + value
        counts[ours] = counts.get(ours, 0) + 1
    sample = EngineSample()
    for name, total in sums.items():
        sample[name] = total / counts[name] if name in _AVERAGED else total
    if "prefix_cache_hit_rate" not in sample and sample.get("prefix_cache_queries"):
        sample["prefix_cache_hit_rate"] = sample.get("prefix_cache_hits", 0.0) / sample["prefix_cache_queries"]
    return sample


class EngineMetrics:
    """The latest sample (or failure) per worker with a `metrics_endpoint`."""

    __slots__ = ("_latest",)

    def __init__(self) -> None:
        self._latest: dict[int, tuple[float, EngineSample | None, str | None]] = {}  # oldest first

    def record(self, worker_id: int, sample: EngineSample | None, error: str | None, now: float) -> None:
        """A scrape's outcome; a failure keeps the last sample beside its error. The workers heard
        of least recently are forgotten past `MAX_WORKERS` (deleted ones among them)."""
        previous = self._latest.pop(worker_id, None)
        if sample is None and previous is not None:
            sample = previous[1]
        self._latest[worker_id] = (now, sample, error)
        if len(self._latest) > MAX_WORKERS:
            del self._latest[next(iter(self._latest))]

    def kv_usage(self, worker_id: int) -> float | None:
        """The share of its KV cache the worker's engine last reported in use, if it did."""
        kept = self._latest.get(worker_id)
        return None if kept is None or kept[1] is None else kept[1].get("kv_usage")

    def hit_rate(self, worker_id: int) -> float | None:
        """The prefix-cache hit rate the worker's engine last reported, if it reports one."""
        kept = self._latest.get(worker_id)
        return None if kept is None or kept[1] is None else kept[1].get("prefix_cache_hit_rate")

    def view(self, worker_id: int, now: float) -> dict[str, Any] | None:
        """What `/loads` shows of the worker's engine, or None before its first scrape."""
        kept = self._latest.get(worker_id)
        if kept is None:
            return None
        at, sample, error = kept
        view: dict[str, Any] = {"worker_id": worker_id, "age_secs": max(0.0, now - at), "error": error}
        for name in ENGINE_METRICS:
            view[name] = None if sample is None else sample.get(name)
        return view
