from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from ledger_server import LedgerServer

from selection_proto import SelectionService, Settings

ROOT = Path(__file__).resolve().parent.parent

# `ci` keeps the whole fuzz part of the suite to a few minutes on 2 cores; `long` is for soak runs:
#   HYPOTHESIS_PROFILE=long python -m pytest tests/test_fuzz.py tests/test_stateful.py tests/test_queue.py
hypothesis_settings.register_profile("ci", max_examples=150, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.register_profile("long", max_examples=20_000, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def vectors_dir() -> Path:
    return Path(os.environ.get("SELECTION_PROTO_VECTORS", ROOT.parent / "shared" / "vectors"))


def load_vectors(name: str) -> list[dict[str, Any]]:
    path = vectors_dir() / name
    if not path.is_file():
        pytest.fail(f"reference vectors missing: {path} (set SELECTION_PROTO_VECTORS)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Client:
    """Calls `handle` with JSON in and out, at an explicit `now`."""

    def __init__(self, service: SelectionService) -> None:
        self.service = service
        self.now = 100.0

    def call(self, method: str, path: str, body: Any = None, query: str = "",
             content_type: str = "application/json", raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        response = self.service.handle(method, path, query, [("content-type", content_type)], data,
                                       now=self.now)
        status, headers, payload = response
        assert dict(headers)["content-length"] == str(len(payload))
        if dict(headers).get("content-type") == "application/json":
            return status, json.loads(payload) if payload else None
        return status, payload.decode()

    def ok(self, method: str, path: str, body: Any = None, query: str = "", status: int = 200) -> Any:
        got, payload = self.call(method, path, body, query)
        assert got == status, payload
        return payload

    def error(self, method: str, path: str, body: Any = None, query: str = "", **kw: Any) -> tuple[int, str]:
        status, payload = self.call(method, path, body, query, **kw)
        assert status >= 400, payload
        return status, payload["error"]


@pytest.fixture
def make_client() -> Iterator[Callable[..., Client]]:
    def make(seed: int = 0, **settings: Any) -> Client:
        settings.setdefault("kv_events", "push")
        return Client(SelectionService(Settings(**settings), random.Random(seed)))

    yield make


@pytest.fixture
def client(make_client: Callable[..., Client]) -> Client:
    return make_client()


def worker(worker_id: int, model: str = "m", block_size: int = 4, **extra: Any) -> dict[str, Any]:
    return {"worker_id": worker_id, "model_name": model, "endpoint": f"http://w{worker_id}:8000",
            "block_size": block_size, **extra}


def stored(worker_id: int, event_id: int, blocks: list[tuple[int, int]], parent: int | None = None,
           tier: str | None = None, dp_rank: int = 0) -> dict[str, Any]:
    event: dict[str, Any] = {"worker_id": worker_id, "event": {"event_id": event_id, "dp_rank": dp_rank,
        "data": {"stored": {"parent_hash": parent,
                            "blocks": [{"block_hash": e, "tokens_hash": t} for e, t in blocks]}}}}
    if tier is not None:
        event["storage_tier"] = tier
    return event


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[LedgerServer]:
    """A real Valkey/Redis server of the test's own (tests/ledger_server.py)."""
    server = LedgerServer(tmp_path).start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real engines' tiny Llama (tests/engines/tiny_model.py), built once for the session."""
    from engines.vllm import build_model

    return build_model(tmp_path_factory.mktemp("tiny"))
