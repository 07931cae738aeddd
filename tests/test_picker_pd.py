"""The endpoint picker for prefill/decode fleets (docs/GATEWAY.md, docs/PD.md): over a real socket
with a real gRPC client, a key with prefill workers is planned (the decode worker as destination,
`x-prefiller-host-port` for a remote plan, SGLang's bootstrap fields in the body), the prefill leg
freed at the first response bytes, the decode leg at the end or a cancellation; a key without
prefill workers is booked as before."""

from __future__ import annotations

import http.client
import json
import queue
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
from test_http import Server, api_call

from selection_proto.adapters.ext_proc import DESTINATION, PREFILLER, ExtProcStream
from selection_proto.core.base.settings import Settings
from selection_proto.core.service import SelectionService

DECODE = {"worker_id": 1, "model_name": "m", "block_size": 4, "endpoint": "http://10.0.0.1:8000", "role": "decode"}
PREFILL = {"worker_id": 3, "model_name": "m", "block_size": 4, "endpoint": "http://10.0.0.3:8100", "role": "prefill"}
PLAIN = {"worker_id": 5, "model_name": "plain", "block_size": 4, "endpoint": "http://10.0.0.5:8000"}


def request_headers(extra: dict[str, str] | None = None) -> ProcessingRequest:
    pairs = {":path": "/v1/completions", ":method": "POST", **(extra or {})}
    return ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])))


def request_body(body: dict[str, Any]) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=json.dumps(body).encode(), end_of_stream=True))


def response_body(data: bytes, end: bool = False) -> ProcessingRequest:
    return ProcessingRequest(response_body=HttpBody(body=data, end_of_stream=end))


def set_headers(reply: ProcessingResponse) -> dict[str, bytes]:
    common = reply.request_headers.response if reply.HasField("request_headers") else reply.request_body.response
    return {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}


def removed_headers(reply: ProcessingResponse) -> list[str]:
    return list(reply.request_headers.response.header_mutation.remove_headers)


def forwarded_body(replies: list[ProcessingResponse]) -> bytes:
    return b"".join(r.request_body.response.body_mutation.streamed_response.body for r in replies
                    if r.HasField("request_body"))


class Picker:
    """`serve --ext-proc-port` with a P/D key (`m`: decode worker 1, prefill worker 3) and a plain
    key (`plain`: worker 5), and a gRPC channel to its picker."""

    def __init__(self, *records: dict[str, Any]) -> None:
        self.server = Server("--ext-proc-port", "0", mode="approximate")
        for record in records or (DECODE, PREFILL, PLAIN):
            assert self.api("POST", "/workers", record)[0] == 201
        self.channel = grpc.insecure_channel(self.server.ext_proc_url().removeprefix("grpc://"))
        self.stub = ExternalProcessorStub(self.channel)

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return api_call(self.server.port, method, path, body)

    def active(self) -> dict[int, int]:
        """Active bookings by worker, over every key."""
        out: dict[int, int] = {}
        for key in self.api("GET", "/loads")[1]:
            for load in key["loads"]:
                out[load["worker_id"]] = out.get(load["worker_id"], 0) + load["active_requests"]
        return out

    def until(self, check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 10
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.active()}"
            time.sleep(0.02)

    def metric(self, prefix: str) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return "".join(line + "\n" for line in text.splitlines() if line.startswith(prefix))

    def call(self, *first: ProcessingRequest) -> tuple[Any, queue.Queue[ProcessingRequest | None]]:
        """A Process call whose next messages the caller puts in the queue (None ends it)."""
        outgoing: queue.Queue[ProcessingRequest | None] = queue.Queue()
        for message in first:
            outgoing.put(message)
        return self.stub.Process(iter(outgoing.get, None), timeout=30), outgoing

    def stop(self) -> None:
        self.channel.close()
        self.server.stop()


@pytest.fixture
def picker() -> Iterator[Picker]:
    running = Picker()
    yield running
    running.stop()


def prompt(seed: int, n: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


def test_a_remote_plan_names_the_prefiller_books_both_hands_off_at_the_first_bytes_and_ends_with_the_answer(
        picker: Picker) -> None:
    body = {"model": "m", "prompt": prompt(1), "max_tokens": 4, "stream": True}
    call, outgoing = picker.call(request_headers(), request_body(body))
    routed = next(call)
    headers = set_headers(routed)
    assert headers[DESTINATION] == b"10.0.0.1:8000" and headers[PREFILLER] == b"10.0.0.3:8100"
    rest = next(call)
    assert json.loads(forwarded_body([rest])) == body  # an llm-d fleet's body goes on unchanged
    assert headers["content-length"] == str(len(json.dumps(body))).encode()
    assert picker.active() == {1: 1, 3: 1, 5: 0}  # both legs booked
    outgoing.put(ProcessingRequest(response_headers=HttpHeaders()))
    assert next(call).HasField("response_headers")
    assert picker.active() == {1: 1, 3: 1, 5: 0}  # headers are no answer yet: P still holds it
    outgoing.put(response_body(b"data: {\"i\": 0}\n\n"))
    assert next(call).response_body.response.body_mutation.streamed_response.body == b"data: {\"i\": 0}\n\n"
    picker.until(lambda: picker.active() == {1: 1, 3: 0, 5: 0}, "the handoff to free the prefill worker")
    outgoing.put(response_body(b"data: [DONE]\n\n", end=True))
    assert next(call).response_body.response.body_mutation.streamed_response.end_of_stream
    picker.until(lambda: picker.active() == {1: 0, 3: 0, 5: 0}, "the end to free the decode worker")
    outgoing.put(None)
    assert list(call) == []
    events = picker.metric("selection_proto_pd_events_total{")
    assert 'event="handoff"} 1.0' in events and 'event="ended"} 1.0' in events
    assert 'route="select_pd_and_reserve",path="remote"' in picker.metric("selection_proto_pd_plans_total{")


@pytest.mark.parametrize("answered", [False, True])
def test_a_cancelled_stream_frees_both_legs(picker: Picker, answered: bool) -> None:
    """Cancelled before the decode worker answered (both legs held) or after (the decode leg)."""
    call, outgoing = picker.call(request_headers(), request_body({"model": "m", "prompt": prompt(2)}))
    next(call), next(call)
    assert picker.active() == {1: 1, 3: 1, 5: 0}
    if answered:
        outgoing.put(ProcessingRequest(response_headers=HttpHeaders()))
        outgoing.put(response_body(b"{\"choices\""))
        next(call), next(call)
        picker.until(lambda: picker.active()[3] == 0, "the handoff")
    call.cancel()  # the gateway's stream reset
    picker.until(lambda: picker.active() == {1: 0, 3: 0, 5: 0}, "the cancellation to free the plan")
    events = picker.metric("selection_proto_pd_events_total{")
    assert 'event="ended"} 1.0' in events and 'event="orphan_expired"' not in events


def test_a_local_plan_books_the_decode_worker_alone_and_drops_a_clients_prefiller() -> None:
    """A decode worker that may prefill locally, holding the prompt: local, no prefiller named,
    and the client's own `x-prefiller-host-port` (which would send its prompt anywhere) removed."""
    picker = Picker({**DECODE, "local_prefill": True}, PREFILL)
    try:
        cached = prompt(3)
        first, _ = picker.call(request_headers(), request_body({"model": "m", "prompt": cached}))
        assert PREFILLER in set_headers(next(first))  # nothing cached on D yet: remote
        first.cancel()
        picker.until(lambda: picker.active() == {1: 0, 3: 0}, "the first plan's end")
        spoofed = {PREFILLER: "169.254.169.254:80"}
        call, outgoing = picker.call(request_headers(spoofed), request_body({"model": "m", "prompt": cached + [7]}))
        routed = next(call)
        assert set_headers(routed)[DESTINATION] == b"10.0.0.1:8000" and PREFILLER not in set_headers(routed)
        assert removed_headers(routed) == [PREFILLER]
        next(call)
        assert picker.active() == {1: 1, 3: 0}
        outgoing.put(response_body(b"{}", end=True))
        next(call)
        picker.until(lambda: picker.active() == {1: 0, 3: 0}, "the end")
        assert 'path="local"' in picker.metric("selection_proto_pd_plans_total{")
    finally:
        picker.stop()


def test_a_key_without_prefill_workers_is_booked_as_before(picker: Picker) -> None:
    body = {"model": "plain", "prompt": prompt(4), "max_tokens": 2}
    call, outgoing = picker.call(request_headers(), request_body(body))
    routed, rest = next(call), next(call)
    assert set_headers(routed) == {DESTINATION: b"10.0.0.5:8000",
                                   "content-length": str(len(json.dumps(body))).encode()}
    assert removed_headers(routed) == [] and json.loads(forwarded_body([rest])) == body
    assert picker.active() == {1: 0, 3: 0, 5: 1}
    outgoing.put(response_body(b"{}", end=True))
    next(call)
    picker.until(lambda: picker.active() == {1: 0, 3: 0, 5: 0}, "the free")
    assert picker.metric("selection_proto_pd_plans_total{") == ""
    assert 'route="select_and_reserve",status="200"' in picker.metric("selection_proto_selections_total{")


def test_an_sglang_prefill_worker_gets_its_bootstrap_fields_in_the_body_and_a_clients_are_replaced() -> None:
    sglang = {**PREFILL, "bootstrap_host": "10.0.0.3", "bootstrap_port": 8998}
    picker = Picker(DECODE, sglang)
    try:
        body = {"model": "m", "prompt": prompt(5), "max_tokens": 2, "bootstrap_host": "evil", "bootstrap_room": 1}
        rooms = []
        for _ in range(2):
            call, outgoing = picker.call(request_headers(), request_body(body))
            routed = next(call)
            forwarded = forwarded_body(list(call_until_body_end(call)))
            sent = json.loads(forwarded)
            assert set_headers(routed)["content-length"] == str(len(forwarded)).encode()
            assert set_headers(routed)[PREFILLER] == b"10.0.0.3:8100"
            assert sent["bootstrap_host"] == "10.0.0.3" and sent["bootstrap_port"] == 8998
            assert isinstance(sent["bootstrap_room"], int) and 0 <= sent["bootstrap_room"] < 2 ** 63
            rooms.append(sent["bootstrap_room"])
            assert {k: v for k, v in sent.items() if not k.startswith("bootstrap_")} == {
                k: v for k, v in body.items() if not k.startswith("bootstrap_")}
            assert forwarded.startswith(json.dumps(body)[:-1].encode())  # spliced: the client's bytes kept
            outgoing.put(response_body(b"{}", end=True))
            next(call)
        assert rooms[0] != rooms[1]  # a room per request
        picker.until(lambda: picker.active() == {1: 0, 3: 0}, "the ends")
    finally:
        picker.stop()


def call_until_body_end(call: Any) -> Iterator[ProcessingResponse]:
    for reply in call:
        yield reply
        if reply.request_body.response.body_mutation.streamed_response.end_of_stream:
            return


def test_buffered_mode_carries_a_rewritten_body_whole_and_a_local_plan_drops_a_clients_bootstrap_fields() -> None:
    """The state machine directly: under BUFFERED request bodies the bootstrap fields ride on the
    body's reply with its new length; a plan without an SGLang prefill worker strips a client's."""
    service = SelectionService(Settings(kv_events="approximate"), random.Random(3))
    for record in (DECODE, {**PREFILL, "bootstrap_host": "fd00::3", "bootstrap_port": 8998}):
        assert service.handle("POST", "/workers", "", [("content-type", "application/json")],
                              json.dumps(record).encode(), now=0.0).status == 201
    stream = ExtProcStream(service)
    config = ProtocolConfiguration(request_body_mode=ProcessingMode.BUFFERED)
    opening = request_headers()
    opening.protocol_config.CopyFrom(config)
    stream.receive(opening, 1.0)
    assert list(stream.replies())[0].HasField("request_headers")
    stream.receive(request_body({"model": "m", "prompt": prompt(6)}), 1.0)
    reply, = list(stream.replies())
    common = reply.request_body.response
    sent = json.loads(common.body_mutation.body)
    assert sent["bootstrap_host"] == "fd00::3" and set_headers(reply)["content-length"] == str(
        len(common.body_mutation.body)).encode()
    stream.close(2.0)
    assert sum(load.requests for pool in service.pools.values() for load in pool.tracker.loads.values()) == 0

    plain = SelectionService(Settings(kv_events="approximate"), random.Random(3))
    for record in ({**DECODE, "role": "both"}, PREFILL):
        assert plain.handle("POST", "/workers", "", [("content-type", "application/json")],
                            json.dumps(record).encode(), now=0.0).status == 201
    stream = ExtProcStream(plain)
    stream.receive(request_headers(), 1.0)
    stream.receive(request_body({"model": "m", "prompt": prompt(7), "bootstrap_host": "evil",
                                 "bootstrap_port": 1}), 1.0)
    replies = list(stream.replies())
    forwarded = forwarded_body(replies[1:])
    sent = json.loads(forwarded)  # the client's own overridden by nulls, as the engine reads them
    assert sent["bootstrap_host"] is sent["bootstrap_port"] is sent["bootstrap_room"] is None
    assert sent["prompt"] == prompt(7)
    assert set_headers(replies[0])["content-length"] == str(len(forwarded_body(replies[1:]))).encode()
    stream.close(2.0)


def test_under_a_strict_ledger_a_plan_waits_for_the_ledgers_word_on_both_legs() -> None:
    """Under a ledger the plan goes through `handle`; strict admission holds its answer until the
    ledger has both legs, then the stream routes it as a plan (and its end frees both)."""
    from selection_proto.core.base.outputs import SelectionReady
    from selection_proto.core.fleet.journal import LedgerSettings
    from selection_proto.core.fleet.ledger_wire import LedgerSnapshot, Reply

    service = SelectionService(Settings(kv_events="approximate"), random.Random(3))
    mirror = service.share(LedgerSettings(admission="strict"), "me")
    mirror.connected(True, 0.0)
    mirror.load(LedgerSnapshot("e", 0, b"0-0", {}, set(), {}, {}, {}, {}, {}), 0.0)
    for record in (DECODE, PREFILL):
        assert service.handle("POST", "/workers", "", [("content-type", "application/json")],
                              json.dumps(record).encode(), now=0.0).status == 201
    mirror.journal.take(100)
    stream = ExtProcStream(service)
    stream.receive(request_headers(), 1.0)
    stream.receive(request_body({"model": "m", "prompt": prompt(8)}), 1.0)
    assert list(stream.replies()) == [] and stream.pending_ticket is not None  # held
    ops = mirror.journal.take(10)
    assert [op.kind for op in ops] == ["add", "add"]
    mirror.results(ops, [Reply("ok", 1), Reply("ok", 2)], 1.0)
    ready, = [out for out in iter(service.next_output, None) if isinstance(out, SelectionReady)]
    assert ready.ticket == stream.pending_ticket
    stream.resolve(ready.response, 1.0)
    routed = list(stream.replies())
    assert set_headers(routed[0])[DESTINATION] == b"10.0.0.1:8000"
    assert set_headers(routed[0])[PREFILLER] == b"10.0.0.3:8100"
    assert stream.plan is not None and stream.booking is None
    loads = {w: load.requests for pool in service.pools.values() for (w, _), load in pool.tracker.loads.items()}
    assert loads == {1: 1, 3: 1}
    stream.close(2.0)
    loads = {w: load.requests for pool in service.pools.values() for (w, _), load in pool.tracker.loads.items()}
    assert loads == {1: 0, 3: 0}


@pytest.mark.parametrize("raw", [b'{"model":"m"}', b'{ "model" : "m" }\n\t ', b'{}', b'{"a":{"b":[1,{}]}}  '])
def test_members_are_appended_last_so_that_they_win_whatever_the_bodys_spacing(raw: bytes) -> None:
    from selection_proto.adapters.openai import with_members

    out = with_members(raw, {"bootstrap_host": "h", "bootstrap_room": 2 ** 63 - 1})
    assert json.loads(out) == {**json.loads(raw), "bootstrap_host": "h", "bootstrap_room": 2 ** 63 - 1}
    assert json.loads(with_members(raw + b"", {})) == json.loads(raw)
    clash = with_members(b'{"bootstrap_host":"evil"}', {"bootstrap_host": None})
    assert json.loads(clash) == {"bootstrap_host": None}


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_through_envoy_the_decode_engine_gets_the_prefiller_and_sglangs_fields(body_mode: str) -> None:
    """A real Envoy in either body mode: the request reaches the decode engine (never the
    prefill one) with our `x-prefiller-host-port`, not the client's, and the bootstrap fields in
    a body whose length Envoy sends right; both legs are freed with the answer."""
    from gateway import Gateway

    gateway = Gateway(engines=2, body_mode=body_mode)
    try:
        decode, prefill = gateway.engines
        assert gateway.api("PATCH", "/workers/1", {"role": "decode"})[0] == 200
        assert gateway.api("PATCH", "/workers/2", {"role": "prefill", "bootstrap_host": prefill.host,
                                                   "bootstrap_port": 8998})[0] == 200
        body = {"model": "m", "prompt": list(range(1, 41)), "max_tokens": 2}
        status, _, payload = gateway.request("/v1/completions", body, headers={PREFILLER: "10.9.9.9:1"})
        assert status == 200 and json.loads(payload)["port"] == decode.port
        assert prefill.requests == []
        _, headers, raw = decode.requests[-1]
        assert headers[PREFILLER] == f"{prefill.host}:{prefill.port}"
        sent = json.loads(raw)
        assert (sent["bootstrap_host"], sent["bootstrap_port"]) == (prefill.host, 8998)
        assert {k: v for k, v in sent.items() if not k.startswith("bootstrap_")} == body
        assert gateway.wait_idle() == 0
    finally:
        gateway.stop()
