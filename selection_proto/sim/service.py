"""`simulate --service URL`: the simulated fleet routed by a running selection service over HTTP
(ours, or Dynamo 1.6.1's `python -m dynamo.select_service`), its engines publishing real vLLM KV
events over ZMQ to it. The part of the simulator that does I/O.

Each engine binds a ZMQ PUB socket on loopback and is registered as a worker naming it; each trace
block is given 512 (the trace block size) synthetic token ids, whose hashes the service computes
itself from the events and that the requests name (`block_hashes`, `sequence_hashes`,
`isl_tokens`, booked under `selection_id`). The workers and their model are this run's own, so
that two runs on one service do not see each other's cache. The service's clock is the real one:
the fleet runs in virtual time as fast as the calls go, waiting a moment after events are
published so that the service has them before the next choice (ZMQ delivers them asynchronously)."""

from __future__ import annotations

import http.client
import json
import random
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import msgpack

from ..core.base.hashing import block_hashes, signed
from ..core.base.outputs import SelectionReady
from ..core.cache.events import KvEvent
from .engine import FleetConfig, SimRequest

__all__ = ["ServiceRouter"]

SETTLE_SECS = 0.002  # after publishing events, before the next call: the service applies them
JOIN_SECS = 1.0  # after registering: the service's SUB sockets connect (ZMQ's slow joiner)


class ServiceRouter:
    """The router of one run: a selection service at `url`."""

    service = None  # not in process

    def __init__(self, url: str, config: FleetConfig) -> None:
        import zmq

        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--service: expected http://HOST:PORT, not {url!r}")
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=60)
        self.block_size = config.trace_block_size
        self.base = random.Random(config.seed).randrange(1, 1 << 40) << 8  # this run's worker ids
        self.model = f"sim-{self.base}"
        self.engines = config.engines
        self.events_failed = 0
        self.settle = False
        self.blocks: dict[int, list[int]] = {}  # a trace block's local hash -> its tokens
        self.context: Any = zmq.Context()
        self.pubs: list[Any] = []
        self.seq: list[int] = []
        for index in range(config.engines):
            pub = self.context.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            port = pub.bind_to_random_port("tcp://127.0.0.1")
            self.pubs.append(pub)
            self.seq.append(0)
            status, body = self._call("POST", "/workers", {
                "worker_id": self.base + index, "model_name": self.model, "endpoint": f"http://sim{index}",
                "block_size": self.block_size, "kv_events_endpoint": f"tcp://127.0.0.1:{port}",
                "total_kv_blocks": config.kv_blocks, "max_num_batched_tokens": config.model.max_batched_tokens})
            if status != 201 or body.get("lifecycle") != "schedulable":
                raise RuntimeError(f"--service {url}: registering a worker answered {status} {body}")
        time.sleep(JOIN_SECS)

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        self.connection.request(method, path, body=data, headers={"content-type": "application/json"})
        answer = self.connection.getresponse()
        raw = answer.read()
        return answer.status, json.loads(raw) if raw else None

    def local_hashes(self, hash_ids: tuple[int, ...]) -> list[int]:
        """Each block's hash as the service computes it from its tokens (Dynamo's, bit for bit)."""
        out = []
        for h in hash_ids:
            tokens = [(h * 1_000_003 + i) % 2_000_000_000 for i in range(self.block_size)]
            local = block_hashes(tokens, self.block_size)[0]
            self.blocks.setdefault(local, tokens)
            out.append(local)
        return out

    def choose(self, req: SimRequest, now: float) -> int | None:
        if self.settle:
            time.sleep(SETTLE_SECS)
            self.settle = False
        status, body = self._call("POST", "/select_and_reserve", {
            "model_name": self.model, "block_hashes": signed(req.locals),
            "sequence_hashes": signed(req.seqs), "isl_tokens": req.isl,
            "selection_id": req.rid, **req.flow})
        if status != 200:
            return None
        engine = body["worker_id"] - self.base
        return engine if 0 <= engine < self.engines else None

    def prefill_done(self, req: SimRequest, now: float) -> None:
        self._call("POST", f"/reservations/{req.rid}/prefill_complete")

    def freed(self, req: SimRequest, now: float) -> None:
        self._call("DELETE", f"/reservations/{req.rid}")

    def events(self, engine: int, events: list[KvEvent], now: float) -> None:
        """The engine's events as vLLM publishes them: one msgpack batch, [topic, seq, payload].
        Engine hashes go as 63-bit numbers (both services read them as i64)."""
        out: list[list[Any]] = []
        for event in events:
            if event.kind == "stored":
                tokens = [t for _, local in event.blocks for t in self.blocks[local]]
                parent = None if event.parent_hash is None else event.parent_hash >> 1
                out.append(["BlockStored", [e >> 1 for e, _ in event.blocks], parent, tokens, self.block_size,
                            None, "GPU", None, None])
            else:
                out.append(["BlockRemoved", [e >> 1 for e in event.block_hashes], "GPU"])
        self.seq[engine] += 1
        payload = msgpack.packb([time.time(), out, 0])
        self.pubs[engine].send_multipart([b"", self.seq[engine].to_bytes(8, "big"), payload])
        self.settle = True

    def ready(self) -> Iterator[SelectionReady]:
        return iter(())  # a blocking HTTP call: nothing is answered later

    def close(self) -> None:
        for index in range(self.engines):
            self._call("DELETE", f"/workers/{self.base + index}")
        self.connection.close()
        for pub in self.pubs:
            pub.close(linger=0)
        self.context.term()
