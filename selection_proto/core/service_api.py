"""The service as its routes see it (`handler.py`): the typed API that `core.service.
SelectionService` offers, as a Protocol, so that the bytes codec and the service it serves do
not import each other (the service hands itself over in `handle`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .catalog import Catalog
from .engine_metrics import EngineMetrics
from .events import KvEvent
from .limits import Limits
from .metrics import Metrics
from .pool import Key, Pool
from .responses import (
    ApplyReport,
    ModelLoadResponse,
    OverlapScoresResponse,
    Pending,
    PotentialLoad,
    ReservationResponse,
    SelectResponse,
    StatusOk,
)
from .settings import Settings
from .types import (
    OverlapScoresRequest,
    PotentialLoadsRequest,
    ReservationRequest,
    SelectAndReserveRequest,
    SelectRequest,
    WorkerCatalogRecord,
    WorkerPatchRequest,
    WorkerRequest,
)

__all__ = ["Service"]


class Service(Protocol):
    """What the routes need of the service (`core.service.SelectionService`)."""

    settings: Settings
    metrics: Metrics
    limits: Limits
    catalog: Catalog
    engines: EngineMetrics
    recovered_from: str | None

    @property
    def pools(self) -> Mapping[Key, Pool]: ...
    def health(self) -> StatusOk: ...
    def serving(self) -> bool: ...
    def readiness(self, *, now: float) -> tuple[bool, int]: ...
    def ready_details(self) -> list[str]: ...
    def internal_error(self, where: str) -> None: ...
    def metrics_text(self, *, now: float) -> str: ...
    def dump(self, model_name: str | None = None, tenant_id: str | None = None) -> dict[str, Any]: ...
    def list_workers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[WorkerCatalogRecord]: ...
    def upsert_worker(self, req: WorkerRequest, *, now: float) -> WorkerCatalogRecord: ...
    def patch_worker(self, worker_id: int, patch: WorkerPatchRequest, *, now: float) -> WorkerCatalogRecord: ...
    def delete_worker(self, worker_id: int, *, now: float) -> WorkerCatalogRecord: ...
    def kv_routing(self, worker_id: int, *, now: float) -> dict[str, Any]: ...
    def loads(self, model_name: str | None = None, tenant_id: str | None = None) -> list[ModelLoadResponse]: ...
    def potential_loads(self, req: PotentialLoadsRequest, *, now: float) -> list[PotentialLoad]: ...
    def overlap_scores(self, req: OverlapScoresRequest, *, now: float) -> OverlapScoresResponse: ...
    def select(self, req: SelectRequest, *, now: float) -> SelectResponse | Pending: ...
    def select_and_reserve(self, req: SelectAndReserveRequest, *, now: float) -> SelectResponse | Pending: ...
    def reserve(self, req: ReservationRequest, *, now: float) -> ReservationResponse: ...
    def prefill_complete(self, reservation_id: str, *, model_name: str | None = None, tenant_id: str | None = None,
                         cached_tokens: int | None = None, now: float) -> None: ...
    def free(self, reservation_id: str, *, model_name: str | None = None, tenant_id: str | None = None,
             cached_tokens: int | None = None, now: float) -> None: ...
    def output_block(self, reservation_id: str, decay_fraction: float | None = None, *, now: float) -> None: ...
    def begin_kv_events(self, events: Sequence[KvEvent], *, now: float, worker_id: int | None = None,
                        dp_rank: int | None = None, model_name: str | None = None,
                        tenant_id: str | None = None) -> ApplyReport | Pending: ...
    def apply_engine_batch(self, payload: bytes, *, worker_id: int | None, dp_rank: int | None = None,
                           seq: int | None = None, stream: int | None = None, now: float,
                           model_name: str | None = None, tenant_id: str | None = None) -> ApplyReport: ...
