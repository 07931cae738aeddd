"""The limits of `Settings` (DECISIONS.md, "Bounds"): each checked here, and each refusal counted
here under its name in `selection_proto_limit_rejections_total`, so a limit's text, status and
label are written once. Limits own no state; they read the settings, the budget and the caller's
counts."""

from __future__ import annotations

from typing import Any

from ..base.budget import InsufficientStorage, StateBudget
from ..base.errors import BadRequest, Conflict, PayloadTooLarge, SelectionError, TooManyRequests
from ..base.metrics import Metrics
from ..base.settings import Settings
from ..bookings.prompt import Prehashed, PromptHashes, PromptTooLong, booking_prompt, selection_prompt
from ..bookings.tracking import KeyedTracking
from .pool import Key, Pool, key_label

__all__ = ["Limits"]


class Limits:
    """Every limit the core enforces; a method raises the refusal after counting it."""

    __slots__ = ("_settings", "_metrics", "_budget", "_tracking", "prehashed")

    def __init__(self, settings: Settings, metrics: Metrics, budget: StateBudget,
                 tracking: KeyedTracking | None = None) -> None:
        self._settings = settings
        self._metrics = metrics
        self._budget = budget
        self._tracking = tracking  # keyed tracking hashes of prompts (tracking.py)
        # The hashes of the huge prompt being handled, when computed ahead (`handler.handle`).
        self.prehashed: Prehashed | None = None

    def _refuse(self, name: str, error: SelectionError) -> SelectionError:
        self._metrics.limit(name)
        return error

    def body_size(self, size: int, limit: int) -> None:
        if size > limit:
            raise self._refuse("body_size", PayloadTooLarge(
                "Failed to buffer the request body: length limit exceeded"))

    def id_length(self, field: str, value: str | None) -> None:
        limit = self._settings.max_id_length
        if value is not None and len(value) > limit:
            raise self._refuse("id_length", BadRequest(f"{field} must be at most {limit} characters"))

    def dp_size(self, size: int | None) -> None:
        limit = self._settings.max_dp_size
        if size is not None and size > limit:
            raise self._refuse("dp_size", BadRequest(
                f"data_parallel_size {size} exceeds the limit of {limit}"))

    def subscriptions(self, total: int) -> None:
        """`total`: the outbound subscriptions there would be."""
        limit = self._settings.max_subscriptions
        if total > limit:
            raise self._refuse("subscriptions", Conflict(
                f"subscription limit reached: at most {limit} outbound KV-event subscriptions"))

    def keys(self, total: int) -> None:
        """`total`: the keys with a worker there would be."""
        if total > self._settings.max_keys:
            raise self._refuse("keys", Conflict(
                f"key limit reached: at most {self._settings.max_keys} model/tenant keys"))

    def workers_per_key(self, key: Key, total: int) -> None:
        limit = self._settings.max_workers_per_key
        if total > limit:
            raise self._refuse("workers_per_key", Conflict(
                f"worker limit reached for {key_label(key)}: at most {limit} workers"))

    def record_bytes(self, size: int) -> None:
        limit = self._settings.max_record_bytes
        if size > limit:
            raise self._refuse("record_bytes", Conflict(
                f"worker record exceeds the limit of {limit} bytes ({size} bytes as JSON)"))

    def state_budget(self, write: str) -> None:
        """507 when the state budget is spent; `write` names what was refused."""
        try:
            self._budget.check(write)
        except InsufficientStorage as exc:
            raise self._refuse("state_bytes", exc) from None

    def stale_store(self) -> None:
        """A stream's store dropped for the budget: counted, not raised (the stream goes on)."""
        self._metrics.limit("state_bytes")

    def prompt(self, req: Any, pool: Pool, booking: bool = False) -> PromptHashes:
        """The request's prompt in the pool's block size, within `max_prompt_tokens`."""
        make = booking_prompt if booking else selection_prompt
        try:
            return make(req, pool.block_size, self._settings.max_prompt_tokens, self._tracking, pool.eagle,
                        self.prehashed)
        except PromptTooLong as exc:
            raise self._refuse("prompt_tokens", exc) from None

    def reservations(self, pool: Pool, rid: str, room: int = 1) -> None:
        """Room for `room` more bookings in the pool (a duplicate id raises DuplicateReservation)."""
        try:
            pool.tracker.check_can_book(rid, room)
        except TooManyRequests as exc:
            raise self._refuse("reservations_per_key", exc) from None
