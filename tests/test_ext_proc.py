"""The endpoint picker's stream state machine (adapters/ext_proc.py) fed Envoy's messages directly,
each rule of docs/GATEWAY.md and each trap of ../shared/notes/gateway.md one test; then the gRPC
server itself over a real socket (cancellation, health) and the tokenizers (adapters/openai.py)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)

from selection_proto.adapters.ext_proc import CHUNK_BYTES, DESTINATION, ExtProcStream
from selection_proto.adapters.openai import ChatTokenizer, OpenAIError, parse_request, text_tokens
from selection_proto.core.base.settings import Settings
from selection_proto.core.service import SelectionService

JSON = [("content-type", "application/json")]


def fleet(**settings: Any) -> SelectionService:
    service = SelectionService(Settings(kv_events="approximate", **settings), random.Random(3))
    for wid in (1, 2):
        worker = {"worker_id": wid, "model_name": "m", "block_size": 4, "endpoint": f"http://10.0.0.{wid}:8000"}
        assert service.handle("POST", "/workers", "", JSON, json.dumps(worker).encode(), now=0.0).status == 201
    return service


def headers(path: str = "/v1/completions", end: bool = False, config: ProtocolConfiguration | None = None,
            ) -> ProcessingRequest:
    message = ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=":path", raw_value=path.encode()), HeaderValue(key=":method", raw_value=b"POST")]),
        end_of_stream=end))
    if config is not None:
        message.protocol_config.CopyFrom(config)
    return message


def body(data: bytes, end: bool = False) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=data, end_of_stream=end))


def response_body(data: bytes, end: bool = False) -> ProcessingRequest:
    return ProcessingRequest(response_body=HttpBody(body=data, end_of_stream=end))


def run(stream: ExtProcStream, *messages: ProcessingRequest) -> list[ProcessingResponse]:
    out: list[ProcessingResponse] = []
    for message in messages:
        stream.receive(message, 1.0)
        out.extend(stream.replies())
        stream.replies_written()  # as the gRPC server does once it wrote them,
        stream._service.deferred.run()  # and then its pump
    return out


def active(service: SelectionService) -> int:
    return sum(load.requests for pool in service.pools.values() for load in pool.tracker.loads.values())


def completion(prompt: Any, model: str = "m", **extra: Any) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, **extra}).encode()


def test_nothing_is_answered_until_the_body_is_whole_then_headers_then_pieces_in_order() -> None:
    service = fleet()
    stream = ExtProcStream(service)
    raw = completion(list(range(30_000)))  # ~180 KB: several pieces
    assert run(stream, headers(), body(raw[:1000]), body(raw[1000:5000])) == []
    replies = run(stream, body(raw[5000:], end=True))
    kinds = [r.WhichOneof("response") for r in replies]
    assert kinds[0] == "request_headers" and set(kinds[1:]) == {"request_body"}
    mutation = replies[0].request_headers.response
    assert mutation.clear_route_cache
    set_headers = {h.header.key: h.header.raw_value for h in mutation.header_mutation.set_headers}
    assert set_headers[DESTINATION] in (b"10.0.0.1:8000", b"10.0.0.2:8000") and not any(
        h.header.value for h in mutation.header_mutation.set_headers)  # raw_value only (envoy#31555)
    assert set_headers["content-length"] == str(len(raw)).encode()
    lb = replies[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value
    assert lb.encode() == set_headers[DESTINATION]
    pieces = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert all(0 < len(p.body) <= CHUNK_BYTES for p in pieces) and b"".join(p.body for p in pieces) == raw
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert active(service) == 1


def test_under_a_strict_ledger_the_destination_waits_for_the_ledgers_word() -> None:
    """Without a ledger the picker selects by the typed call; under one through `handle`, whose
    answer strict admission holds until the ledger has the booking."""
    from selection_proto.core.base.outputs import SelectionReady
    from selection_proto.core.fleet.journal import LedgerSettings
    from selection_proto.core.fleet.ledger_wire import LedgerSnapshot, Reply

    service = SelectionService(Settings(kv_events="approximate"), random.Random(3))
    mirror = service.share(LedgerSettings(admission="strict"), "me")
    mirror.connected(True, 0.0)
    mirror.load(LedgerSnapshot("e", 0, b"0-0", {}, set(), {}, {}, {}, {}, {}), 0.0)
    worker = {"worker_id": 1, "model_name": "m", "block_size": 4, "endpoint": "http://10.0.0.1:8000"}
    assert service.handle("POST", "/workers", "", JSON, json.dumps(worker).encode(), now=0.0).status == 201
    mirror.journal.take(100)
    stream = ExtProcStream(service)
    assert run(stream, headers(), body(completion(list(range(16))), end=True)) == []  # held
    assert stream.pending_ticket is not None
    ops = mirror.journal.take(10)
    assert [op.kind for op in ops] == ["add"]
    mirror.results(ops, [Reply("ok", 1)], 1.0)
    ready, = [out for out in iter(service.next_output, None) if isinstance(out, SelectionReady)]
    assert ready.ticket == stream.pending_ticket
    stream.resolve(ready.response, 1.0)
    routed = list(stream.replies())
    assert routed[0].request_headers.response.header_mutation.set_headers[0].header.raw_value == b"10.0.0.1:8000"
    assert active(service) == 1


def test_a_duplicate_end_of_stream_is_ignored() -> None:
    """Envoy 1.35+ may deliver the final body chunk twice for bodies near 1 MB (envoy#46237)."""
    service = fleet()
    stream = ExtProcStream(service)
    raw = completion([1, 2, 3, 4, 5])
    first = run(stream, headers(), body(raw, end=True))
    assert len(first) == 2 and run(stream, body(raw, end=True)) == [] and active(service) == 1


def test_the_response_is_echoed_at_once_prefill_marked_by_the_first_chunk_and_freed_once() -> None:
    service = fleet()
    stream = ExtProcStream(service)
    run(stream, headers(), body(completion(list(range(40))), end=True))
    (rid, _, _), = [stream.booking]  # type: ignore[misc]
    pool = next(iter(service.pools.values()))
    assert run(stream, ProcessingRequest(response_headers=HttpHeaders()))[0].HasField("response_headers")
    assert not pool.tracker.bookings[rid].prefill_done
    stream.receive(response_body(b"data: 1\n\n"), 1.0)
    echoed = list(stream.replies())
    assert echoed[0].response_body.response.body_mutation.streamed_response.body == b"data: 1\n\n"
    assert not pool.tracker.bookings[rid].prefill_done  # the echo first: the engine's bytes wait for nothing
    service.deferred.run()  # then what it changes, once it is written
    assert pool.tracker.bookings[rid].prefill_done and active(service) == 1
    big = b"x" * (CHUNK_BYTES * 2 + 5)  # a response chunk larger than Envoy allows back: cut
    assert [len(r.response_body.response.body_mutation.streamed_response.body)
            for r in run(stream, response_body(big))] == [CHUNK_BYTES, CHUNK_BYTES, 5]
    last = run(stream, response_body(b"data: [DONE]\n\n", end=True))
    assert last[-1].response_body.response.body_mutation.streamed_response.end_of_stream
    assert active(service) == 0
    stream.close(2.0)  # the gRPC stream's own end afterwards frees nothing more
    run(stream, ProcessingRequest(response_trailers=HttpTrailers()))
    assert active(service) == 0 and "selection_proto_internal_errors_total{" not in service.metrics_text(now=2.0)


def test_response_trailers_and_a_cancelled_stream_each_free_the_booking() -> None:
    service = fleet()
    ended = ExtProcStream(service)
    run(ended, headers(), body(completion([1] * 8), end=True))
    replies = run(ended, ProcessingRequest(response_headers=HttpHeaders()), response_body(b"{}"),
                  ProcessingRequest(response_trailers=HttpTrailers()))
    assert replies[-1].HasField("response_trailers") and active(service) == 0
    cancelled = ExtProcStream(service)
    run(cancelled, headers(), body(completion([2] * 8), end=True))
    assert active(service) == 1
    cancelled.close(2.0)
    cancelled.close(2.0)
    assert active(service) == 0


def test_a_body_ended_by_request_trailers_is_routed_and_the_trailers_answered() -> None:
    from selection_proto.adapters.inflight import InFlight

    service, budget = fleet(), InFlight(100_000)
    stream = ExtProcStream(service, in_flight=budget)
    replies = run(stream, headers(), body(completion([3] * 8)), ProcessingRequest(request_trailers=HttpTrailers()))
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body", "request_trailers"]
    assert budget.used == 0 and active(service) == 1  # whole: its bytes are back while the answer runs


@pytest.mark.parametrize(("raw", "status", "needle"), [
    (b'{"model": "m", "prompt": [1, 2', 400, "not valid JSON"),
    (b'[1, 2, 3]', 400, "JSON object"),
    (b'{"prompt": [1, 2, 3]}', 400, "model is required"),
    (b'{"model": "m", "prompt": [1, -2]}', 400, "token_ids"),
    (b'{"model": "m", "prompt": [1, 1e400]}', 400, "token_ids"),
    (b'{"model": "m", "prompt": [1, true]}', 400, "token_ids"),
    (b'{"model": "m", "prompt": {"a": 1}}', 400, "prompt must be"),
    (b'{"model": "m", "prompt": [' + b"9" * 5000 + b"]}", 400, ""),
    (b'{"model": "m", "prompt": "\\ud800 lone"}', 200, ""),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', 200, ""),
    (b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, ""),
    (b'{"model": "nope", "prompt": [1, 2, 3]}', 404, "does not exist"),
    (b'{"model": "m", "prompt": [1, 2, 3], "extra": "' + b"a" * (9 << 20) + b'"}', 413, "exceeds"),
])
def test_hostile_bodies_get_an_immediate_openai_error_and_change_nothing(raw: bytes, status: int, needle: str) -> None:
    service = fleet()
    stream = ExtProcStream(service)
    replies = run(stream, headers(), *[body(raw[i:i + 65536], end=i + 65536 >= len(raw))
                                        for i in range(0, len(raw), 65536)])
    if status == 200:
        assert replies[0].HasField("request_headers") and active(service) == 1
        return
    assert len(replies) == 1 and stream.finished and active(service) == 0
    immediate = replies[0].immediate_response
    assert immediate.status.code == status
    error = json.loads(immediate.body)["error"]
    assert needle in error["message"] and error["code"] == status
    assert {h.header.key: h.header.raw_value for h in immediate.headers.set_headers} == {
        "content-type": b"application/json"}
    assert run(stream, response_body(b"late", end=True)) == []  # nothing after the end
    assert f'selection_proto_ext_proc_streams_total{{outcome="{status}"}} 1' in service.metrics_text(now=2.0)


def test_bodies_being_received_count_against_the_servers_buffer_budget() -> None:
    from selection_proto.adapters.inflight import InFlight

    service, budget = fleet(), InFlight(100_000)
    stalled = ExtProcStream(service, in_flight=budget)
    assert run(stalled, headers(), body(b"x" * 60_000)) == [] and budget.used == 60_000
    refused = ExtProcStream(service, in_flight=budget)
    replies = run(refused, headers(), body(b"y" * 50_000))
    assert replies[0].immediate_response.status.code == 503 and budget.used == 60_000
    whole = ExtProcStream(service, in_flight=budget)
    whole.receive(headers(), 1.0)
    whole.receive(body(completion([1] * 8), end=True), 1.0)
    assert [r.WhichOneof("response") for r in whole.replies()] == ["request_headers", "request_body"]
    # Held until the echo of the body is written (a peer that reads nothing holds its bytes).
    assert budget.used == 60_000 + len(completion([1] * 8)) and active(service) == 1
    whole.replies_written()
    assert budget.used == 60_000
    stalled.close(2.0)
    whole.close(2.0)
    assert budget.used == 0 and active(service) == 0


def test_the_subset_hint_is_read_from_metadata_and_an_empty_one_answers_503() -> None:
    service = fleet()
    for hint, expected in ((["10.0.0.2:8000"], b"10.0.0.2:8000"), (["10.0.0.1:1"], b"10.0.0.1:8000"), ([], None)):
        stream = ExtProcStream(service)
        message = headers()
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
            {"x-gateway-destination-endpoint-subset": hint})
        replies = run(stream, message, body(completion([5] * 8), end=True))
        if expected is None:
            assert replies[0].immediate_response.status.code == 503
        else:
            set_headers = replies[0].request_headers.response.header_mutation.set_headers
            assert set_headers[0].header.raw_value == expected
        stream.close(2.0)


def test_a_request_without_a_body_is_routed_at_once_and_books_nothing() -> None:
    service = fleet()
    stream = ExtProcStream(service)
    replies = run(stream, headers("/v1/models", end=True))
    assert replies[0].request_headers.response.header_mutation.set_headers[0].header.key == DESTINATION
    assert active(service) == 0 and stream.booking is None


def test_buffered_mode_answers_the_headers_at_once_and_routes_on_the_body_reply() -> None:
    service = fleet()
    stream = ExtProcStream(service)
    config = ProtocolConfiguration(request_body_mode=ProcessingMode.BUFFERED,
                                   response_body_mode=ProcessingMode.BUFFERED)
    first = run(stream, headers(config=config))
    assert first[0].HasField("request_headers") and not first[0].request_headers.response.HasField("header_mutation")
    routed = run(stream, body(completion([6] * 8), end=True))
    assert len(routed) == 1 and routed[0].request_body.response.header_mutation.set_headers[0].header.key == DESTINATION
    assert not routed[0].request_body.response.HasField("body_mutation")
    answered = run(stream, response_body(b"{}", end=True))
    assert answered[0].HasField("response_body") and not answered[0].response_body.response.HasField("body_mutation")
    assert active(service) == 0


def test_a_queued_selection_waits_and_a_stream_ended_meanwhile_gives_it_up() -> None:
    service = fleet(queue_threshold=0.5)
    for wid in (1, 2):
        patch = {"max_num_batched_tokens": 4}
        assert service.handle("PATCH", f"/workers/{wid}", "", JSON, json.dumps(patch).encode(), now=0.0).status == 200
    busy = [ExtProcStream(service) for _ in range(2)]
    for n, stream in enumerate(busy):
        run(stream, headers(), body(completion([n] * 40), end=True))
    waiting = ExtProcStream(service)
    assert run(waiting, headers(), body(completion([9] * 40), end=True)) == []
    assert waiting.pending_ticket is not None
    gone = ExtProcStream(service)
    run(gone, headers(), body(completion([8] * 40), end=True))
    gone.close(1.5)  # left while queued: its ticket is cancelled
    busy[0].close(2.0)  # a rank frees: the first queued selection runs
    ready = service.next_output()
    while ready is not None and getattr(ready, "ticket", None) != waiting.pending_ticket:
        ready = service.next_output()
    assert ready is not None
    waiting.resolve(ready.response, 2.0)  # type: ignore[attr-defined]
    assert next(waiting.replies()).HasField("request_headers")
    waiting.close(3.0)
    busy[1].close(3.0)
    assert active(service) == 0


def test_text_tokens_share_their_leading_blocks() -> None:
    a, b = text_tokens("hello world, this is shared" + "A"), text_tokens("hello world, this is shared" + "B")
    assert a[:6] == b[:6] and a != b and text_tokens("") == [] and text_tokens("ab") == [ord("a") | ord("b") << 8]


def small_tokenizer() -> tuple[str, dict[str, Any]]:
    """A word-level tokenizer built here (nothing is fetched), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "hello", "world", "how",
                                         "are", "you", "?", ",", "\n"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="removed")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template":
              "{{ bos_token }}{% for m in messages %} <|{{ m['role'] }}|> {{ m['content'] }}{% endfor %}"
              "{% if add_generation_prompt %} <|assistant|>{% endif %}"}
    return tokenizer.to_str(), config


def test_a_models_tokenizer_and_chat_template_give_the_engines_token_ids() -> None:
    text, config = small_tokenizer()
    tokenizers = {"m": ChatTokenizer(text, config)}
    completion_prompt = parse_request(completion("hello world"), tokenizers)
    assert completion_prompt.exact and completion_prompt.token_ids == [1, 5, 6]  # <s> added, as vLLM adds it
    chat = parse_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "how are you ?"}]}).encode(),
                         tokenizers)
    assert chat.token_ids == [1, 3, 7, 8, 9, 10, 4]  # the template's <s>, not a second one
    other = parse_request(completion("hello world", model="x"), tokenizers)
    assert not other.exact and other.token_ids == text_tokens("hello world")
    with pytest.raises(OpenAIError, match="cannot be tokenized"):
        parse_request(b'{"model": "m", "prompt": "\\ud800"}', tokenizers)
    with pytest.raises(OpenAIError, match="chat template"):
        ChatTokenizer(text, {**config, "chat_template": "{{ raise_exception('no system role') }}"}).chat(
            [{"role": "system", "content": "x"}], {})


def test_tokenized_chats_route_to_the_engine_holding_their_blocks() -> None:
    """With the model's tokenizer the picker hashes exactly what the engine reported in its KV
    events (kv_events push), so a chat goes where its prefix is cached."""
    from selection_proto.core.base.hashing import block_hashes

    text, config = small_tokenizer()
    tokenizer = ChatTokenizer(text, config)
    service = SelectionService(Settings(kv_events="push"), random.Random(1))
    for wid in (1, 2):
        worker = {"worker_id": wid, "model_name": "m", "block_size": 2, "endpoint": f"http://10.0.0.{wid}:8000"}
        service.handle("POST", "/workers", "", JSON, json.dumps(worker).encode(), now=0.0)
    messages = [{"role": "user", "content": "hello world how are you ?"}]
    tokens = tokenizer.chat(messages, {})
    hashes = block_hashes(tokens, 2)
    stored = [{"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": h, "tokens_hash": h} for h in hashes]}}}]
    assert service.handle("POST", "/kv_events", "worker_id=2", JSON, json.dumps(stored).encode(), now=0.0).status == 200
    for _ in range(4):
        stream = ExtProcStream(service, {"m": tokenizer})
        replies = run(stream, headers("/v1/chat/completions"), body(json.dumps(
            {"model": "m", "messages": messages}).encode(), end=True))
        assert replies[0].request_headers.response.header_mutation.set_headers[0].header.raw_value == b"10.0.0.2:8000"
        stream.close(2.0)


def test_the_grpc_server_frees_a_cancelled_streams_booking_and_serves_health() -> None:
    """Over a real socket: a client that cancels its Process call mid-response leaves nothing
    booked; health answers SERVING for the names gateways probe."""
    import queue
    import time

    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from gateway import Gateway
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    gw = Gateway(engines=2)  # its Envoy is not used here: the picker is called directly
    channel = grpc.insecure_channel(f"127.0.0.1:{gw.ext_proc_port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "envoy.service.ext_proc.v3.ExternalProcessor", "liveness", "readiness"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING
        outgoing: queue.Queue[ProcessingRequest | None] = queue.Queue()
        for message in (headers(), body(completion(list(range(64))), end=True),
                        ProcessingRequest(response_headers=HttpHeaders()), response_body(b"data: 1\n\n")):
            outgoing.put(message)
        call = ExternalProcessorStub(channel).Process(iter(outgoing.get, None))
        replies = [next(call) for _ in range(4)]
        assert replies[-1].response_body.response.body_mutation.streamed_response.body == b"data: 1\n\n"
        assert gw.active_requests() == 1
        call.cancel()  # the gateway's stream reset
        assert gw.wait_idle(timeout=5) == 0
        # An immediate response ends its stream; the next stream is served.
        refused = list(ExternalProcessorStub(channel).Process(iter([headers(), body(b"{", end=True)])))
        assert len(refused) == 1 and refused[0].immediate_response.status.code == 400
        served = list(ExternalProcessorStub(channel).Process(iter([headers(), body(completion([1] * 8), end=True)])))
        assert served[0].HasField("request_headers")
        time.sleep(0.2)
        assert gw.wait_idle() == 0  # the stream ended after its body: freed at the stream's end
    finally:
        channel.close()
        gw.stop()


@pytest.mark.parametrize(("endpoint", "destination"), [
    ("http://10.1.2.3:8000/v1", b"10.1.2.3:8000"), ("10.1.2.3:9", b"10.1.2.3:9"), ("https://10.1.2.3", b"10.1.2.3:443"),
    ("http://localhost:8001", b"127.0.0.1:8001"), ("http://[fd00::1]:8000", b"[fd00::1]:8000"),
])
def test_the_destination_is_the_workers_endpoint_as_ip_and_port(endpoint: str, destination: bytes) -> None:
    service = SelectionService(Settings(kv_events="approximate"), random.Random(3))
    worker = {"worker_id": 1, "model_name": "m", "block_size": 4, "endpoint": endpoint}
    assert service.handle("POST", "/workers", "", JSON, json.dumps(worker).encode(), now=0.0).status == 201
    stream = ExtProcStream(service)
    replies = run(stream, headers(), body(completion([1] * 8), end=True))
    assert replies[0].request_headers.response.header_mutation.set_headers[0].header.raw_value == destination


def test_with_tls_flags_the_picker_serves_grpc_over_tls(tmp_path: Any) -> None:
    """`--tls-cert/--tls-key` secure the ext_proc port too, as the gateways' generated configs
    expect (TLS with ALPN h2, certificate not verified by them; verified here)."""

    import grpc
    import trustme
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from test_http import Server

    authority = trustme.CA()
    certificate = authority.issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    certificate.cert_chain_pems[0].write_to_path(str(cert))
    certificate.private_key_pem.write_to_path(str(key))
    server = Server("--tls-cert", str(cert), "--tls-key", str(key), "--ext-proc-port", "0")
    try:
        url = server.ext_proc_url()
        assert url.startswith("grpcs://127.0.0.1:")
        credentials = grpc.ssl_channel_credentials(authority.cert_pem.bytes())
        with grpc.secure_channel(url[len("grpcs://"):], credentials) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()


def test_serve_loads_a_models_tokenizer_folder_and_refuses_bad_flags_in_one_line(tmp_path: Any) -> None:
    """`--tokenizer m=FOLDER` (tokenizer.json and tokenizer_config.json): a chat through the picker
    is booked on its tokens; a missing file, a malformed pair and a port in use each end `serve`
    with one line and no traceback."""
    import socket
    import subprocess
    import sys
    import time

    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from test_http import Server

    text, config = small_tokenizer()
    (tmp_path / "tokenizer.json").write_text(text)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    server = Server("--ext-proc-port", "0", "--tokenizer", f"m={tmp_path}", mode="approximate")
    try:
        deadline = time.monotonic() + 20
        while not (lines := [line for line in server.logs if '"ext_proc_listening"' in line]):
            assert time.monotonic() < deadline, "".join(server.logs)
            time.sleep(0.05)
        record = json.loads(lines[0])
        assert record["tokenizers"] == ["m"]
        worker = {"worker_id": 1, "model_name": "m", "block_size": 2, "endpoint": "http://10.0.0.1:8000"}
        from test_hostile import post

        assert post(server, "/workers", json.dumps(worker).encode())[0] == 201
        chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "how are you ?"}]}).encode()
        with grpc.insecure_channel(record["url"][len("grpc://"):]) as channel:
            call = ExternalProcessorStub(channel).Process(iter([headers("/v1/chat/completions"), body(chat, end=True)]))
            replies = list(call)
        assert replies[0].request_headers.response.header_mutation.set_headers[0].header.raw_value == b"10.0.0.1:8000"
        # Approximate mode predicts the booked prompt cached there: the template's tokens, exactly.
        status, scores = post(server, "/overlap_scores", json.dumps(
            {"model_name": "m", "token_ids": [1, 3, 7, 8, 9, 10, 4]}).encode())
        assert status == 200 and [(w["worker_id"], w["device_blocks"]) for w in scores["workers"]] == [(1, 3)]
    finally:
        server.stop()
    for flags, message in ((["--tokenizer", f"m={tmp_path / 'missing'}"], "--tokenizer m="),
                           (["--tokenizer", "m"], "expected MODEL=PATH")):
        done = subprocess.run([sys.executable, "-m", "selection_proto", "serve", "--port", "0", "--ext-proc-port", "0",
                               *flags], capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = subprocess.run([sys.executable, "-m", "selection_proto", "serve", "--port", "0", "--ext-proc-port",
                               str(taken.getsockname()[1])], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "for ext_proc" in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("backend", ["trio", "uvloop"])
def test_the_picker_serves_on_trio_and_uvloop_too(backend: str) -> None:
    """The picker's gRPC runs on anyio (grpc.aio ran on asyncio only, and trio was refused):
    under `--backend trio` and `--backend uvloop` health answers and a prompt is routed and freed."""
    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from test_http import Server, api_call

    server = Server("--ext-proc-port", "0", "--backend", backend, mode="approximate")
    try:
        assert api_call(server.port, "POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": 4,
                                                          "endpoint": "http://10.0.0.1:8000"})[0] == 201
        with grpc.insecure_channel(server.ext_proc_url().removeprefix("grpc://")) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            replies = list(ExternalProcessorStub(channel).Process(
                iter([headers(), body(completion(list(range(16))), end=True)]), timeout=10))
        assert replies[0].request_headers.response.header_mutation.set_headers[0].header.raw_value == b"10.0.0.1:8000"
        assert api_call(server.port, "GET", "/loads")[1][0]["loads"][0]["active_requests"] == 0
    finally:
        server.stop()


def test_a_backend_is_checked_before_anything_starts_and_a_missing_one_named(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from selection_proto.cli import main

    assert main(["serve", "--backend", "uvlop"], env={}) == 2
    assert capsys.readouterr().err.strip() == ("selection-proto: error: --backend: invalid choice 'uvlop' "
                                               "(choose from asyncio, uvloop, trio)")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed
    assert main(["serve", "--backend", "uvloop"], env={}) == 2
    assert capsys.readouterr().err.strip() == ("selection-proto: error: --backend uvloop: no module named 'uvloop'; "
                                               "install 'selection-proto[uvloop]'")


def test_the_pickers_port_needs_the_servers_bearer_token(tmp_path: Any) -> None:
    """With `--auth-token-file` a stream without `authorization: Bearer <token>` gRPC
    metadata (or with another token) is refused UNAUTHENTICATED and books nothing; with it, it is
    routed; gRPC health stays open, as `/health` is."""
    import http.client

    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from test_http import Server, api_call

    (tmp_path / "token").write_text("s3cret\n")
    server = Server("--auth-token-file", str(tmp_path / "token"), "--ext-proc-port", "0", mode="approximate")
    try:
        target = server.ext_proc_url().removeprefix("grpc://")
        worker = {"worker_id": 1, "model_name": "m", "block_size": 4, "endpoint": "http://127.0.0.1:9"}
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("POST", "/workers", json.dumps(worker), {"content-type": "application/json",
                                                              "authorization": "Bearer s3cret"})
        assert conn.getresponse().status == 201
        conn.close()
        messages = [headers(), body(completion(list(range(16))), end=True)]
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = ExternalProcessorStub(channel)
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    list(stub.Process(iter(messages), metadata=metadata, timeout=10))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            replies = list(stub.Process(iter(messages), metadata=(("authorization", "Bearer s3cret"),), timeout=10))
            assert replies and replies[0].HasField("request_headers")
        assert api_call(server.port, "GET", "/health") == (200, {"status": "ok"})
    finally:
        server.stop()


def test_a_body_that_never_completes_is_refused_after_the_request_timeout_and_frees_its_bytes() -> None:
    """A picker stream holding an unfinished body kept its bytes of the shared budget for
    as long as it stayed open; now it has `--request-timeout-secs`, then 408 and the bytes back."""
    import threading
    import time

    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from test_http import Server, api_call

    server = Server("--ext-proc-port", "0", "--request-timeout-secs", "1", "--max-buffer-bytes",
                    str(12 << 20), mode="approximate")
    try:
        target = server.ext_proc_url().removeprefix("grpc://")
        assert api_call(server.port, "POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": 4,
                                                          "endpoint": "http://127.0.0.1:9"})[0] == 201
        held = threading.Event()

        def stalled() -> Any:
            yield headers()
            yield headers()  # repeated headers are ignored, not stored again
            yield body(b'{"model": "m", "prompt": "' + b"x" * (7 << 20))  # and never the rest
            held.wait(30)

        with grpc.insecure_channel(target) as channel:
            stub = ExternalProcessorStub(channel)
            started = time.monotonic()
            replies = stub.Process(stalled(), timeout=20)
            first = next(replies)
            assert first.immediate_response.status.code == 408, first
            assert 0.9 < time.monotonic() - started < 10
            assert b"did not arrive within 1 s" in first.immediate_response.body
            held.set()
            # The bytes are back: a 5.6 MB body, which beside the stalled 7 MiB would not fit the
            # 12 MiB budget, is routed.
            complete = [headers(), body(completion(list(range(100_000, 900_000))), end=True)]
            answer = list(stub.Process(iter(complete), timeout=20))
            assert answer and answer[0].HasField("request_headers"), answer[:1]
        assert api_call(server.port, "GET", "/health") == (200, {"status": "ok"})
    finally:
        server.stop()


def test_a_stream_whose_headers_come_after_its_time_is_refused_at_once_and_others_flow_meanwhile() -> None:
    """A stream's `--request-timeout-secs` runs from its start: one silent past it, then sending
    its headers and half a body, is refused 408 at once (not a second later), while streams
    opened behind the silent one are served as usual."""
    import threading
    import time

    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from test_http import Server, api_call

    server = Server("--ext-proc-port", "0", "--request-timeout-secs", "1", mode="approximate")
    try:
        target = server.ext_proc_url().removeprefix("grpc://")
        assert api_call(server.port, "POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": 4,
                                                          "endpoint": "http://127.0.0.1:9"})[0] == 201
        held, spoke = threading.Event(), threading.Event()
        spoke_at: list[float] = []

        def late() -> Any:
            held.wait(1.6)  # silent past its 1 s
            spoke_at.append(time.monotonic())
            spoke.set()
            yield headers()
            yield body(b'{"model": "m", "prompt": "x')
            held.wait(30)

        with grpc.insecure_channel(target) as channel:
            stub = ExternalProcessorStub(channel)
            replies = stub.Process(late(), timeout=20)
            for _ in range(3):  # behind the silent stream, others come and go
                answer = list(stub.Process(iter([headers(), body(completion([1, 2, 3, 4, 5]), end=True)]), timeout=5))
                assert answer and answer[0].HasField("request_headers"), answer[:1]
            assert not spoke.is_set()
            first = next(replies)
            refused_after = time.monotonic()
            assert spoke.is_set() and first.immediate_response.status.code == 408, first
            held.set()
        assert refused_after - spoke_at[0] < 0.8  # at once, not after another timeout
        assert api_call(server.port, "GET", "/health") == (200, {"status": "ok"})
        assert all(load["active_requests"] == 0 for key in api_call(server.port, "GET", "/loads")[1]
                   for load in key["loads"])
    finally:
        server.stop()


def test_picker_streams_are_capped_by_max_connections() -> None:
    """The picker had no cap on streams (the descriptor limit counted HTTP only): past
    `--max-connections` open streams a new one is refused RESOURCE_EXHAUSTED, counted, and served
    again once one ends; HTTP answers throughout."""
    import threading
    import time

    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from test_http import Server, api_call

    server = Server("--ext-proc-port", "0", "--max-connections", "4", mode="approximate")
    release = threading.Event()
    try:
        target = server.ext_proc_url().removeprefix("grpc://")

        def held() -> Any:  # a stream that sends its headers and waits
            yield headers()
            release.wait(30)

        with grpc.insecure_channel(target) as channel:
            stub = ExternalProcessorStub(channel)
            open_streams = [stub.Process(held(), timeout=30) for _ in range(4)]
            time.sleep(0.5)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Process(iter([headers(path="/v1/models", end=True)]), timeout=10))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "at most 4" in (refused.value.details() or "")
            assert api_call(server.port, "GET", "/health") == (200, {"status": "ok"})
            release.set()
            for call in open_streams:
                call.cancel()
            time.sleep(0.5)
            replies = list(stub.Process(iter([headers(path="/v1/models", end=True)]), timeout=10))
            assert replies  # a bodyless request is answered again
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as answer:
            assert 'selection_proto_limit_rejections_total{limit="ext_proc_streams"} 1.0' in answer.read().decode()
    finally:
        release.set()
        server.stop()


def test_the_decision_rides_on_the_header_mutation_when_asked() -> None:
    """With `explain_header` the picker adds `x-selection-decision` to the request it
    routes (the engine and its logs see why); not otherwise."""
    for on in (False, True):
        service = fleet(explain_header=on)
        replies = run(ExtProcStream(service), headers(), body(completion(list(range(16))), end=True))
        mutation = replies[0].request_headers.response.header_mutation
        found = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
        assert "x-gateway-destination-endpoint" in found
        if on:
            assert found["x-selection-decision"].startswith("worker=") and ";isl=16;candidates=2;" in found[
                "x-selection-decision"]
        else:
            assert "x-selection-decision" not in found


def test_replies_a_peer_does_not_read_hold_their_bytes_of_the_budget() -> None:
    """A stream whose peer never reads the echoed body kept it (~6 MB) outside the
    byte budget, so 150 such streams grew the server by 837 MB. The body's bytes now stay in
    `--max-buffer-bytes` until its echo is written: past the budget, bodies are refused (503),
    and served again once the silent stream goes; HTTP answers throughout."""
    import threading
    import time

    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from test_http import Server, api_call

    server = Server("--ext-proc-port", "0", "--max-buffer-bytes", str(12 << 20), mode="approximate")
    release = threading.Event()
    try:
        target = server.ext_proc_url().removeprefix("grpc://")
        assert api_call(server.port, "POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": 16,
                                                          "endpoint": "http://127.0.0.1:9"})[0] == 201
        big = completion(list(range(1_000_000)))  # 7.9 MB

        def loads() -> int:
            return sum(w["active_requests"] for key in api_call(server.port, "GET", "/loads")[1] for w in key["loads"])

        # A raw HTTP/2 peer that never gives back its window: the picker can send it 64 KiB of
        # the echo, no more (a gRPC client's transport would read ahead for its application).
        silent = threading.Thread(target=_silent_call, daemon=True, args=(
            int(target.rsplit(":", 1)[1]), [headers(), body(big, end=True)], release))
        silent.start()
        deadline = time.monotonic() + 10
        while loads() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loads() == 1
        with grpc.insecure_channel(target) as channel:
            stub = ExternalProcessorStub(channel)
            other = [headers(), body(completion(list(range(100_000, 800_000))), end=True)]  # 5.5 MB
            refused = list(stub.Process(iter(other), timeout=20))
            assert refused[0].immediate_response.status.code == 503, refused[:1]
            assert b"budget of bytes in flight" in refused[0].immediate_response.body
            assert api_call(server.port, "GET", "/health") == (200, {"status": "ok"})
            release.set()
            silent.join(10)
            deadline = time.monotonic() + 10
            while loads() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert loads() == 0  # its booking freed, its bytes back
            answer = list(stub.Process(iter(other), timeout=20))
            assert answer[0].HasField("request_headers"), answer[:1]
    finally:
        release.set()
        server.stop()


def _silent_call(port: int, messages: list[ProcessingRequest], release: Any) -> None:
    """A Process call over raw HTTP/2 that sends `messages` as the server's window allows, reads
    only what it must (the server's window updates), never acknowledges a reply's bytes, and
    goes (closes the connection) once `release` is set."""
    import socket

    import h2.config
    import h2.connection

    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    with socket.create_connection(("127.0.0.1", port), timeout=0.05) as sock:
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"picker"),
                                        (b":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
                                        (b"content-type", b"application/grpc"), (b"te", b"trailers")])
        rest = b"".join(len(m.SerializeToString()).to_bytes(5, "big") + m.SerializeToString() for m in messages)
        while not release.is_set():
            room = min(client.local_flow_control_window(stream_id), len(rest))
            for start in range(0, room, 16_384):
                client.send_data(stream_id, rest[start:min(room, start + 16_384)])
            rest = rest[room:]
            sock.sendall(client.data_to_send())
            try:
                client.receive_data(sock.recv(65536))
            except TimeoutError:
                pass


def test_open_streams_keep_no_parsed_prompt() -> None:
    """A routed stream stays open for its whole response; it kept its parsed body (a million
    token ids: ~36 MB of Python ints) through the parsed body's `exact` reader, so 50 open streams
    held 2.2 GB. Ten open streams with million-token prompts now grow the server by their
    bookings only."""
    import threading

    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from test_hardening import rss_bytes
    from test_http import Server, api_call

    server = Server("--ext-proc-port", "0", mode="approximate")
    release = threading.Event()
    try:
        target = server.ext_proc_url().removeprefix("grpc://")
        assert api_call(server.port, "POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": 16,
                                                          "endpoint": "http://127.0.0.1:9"})[0] == 201
        before = rss_bytes(server.proc.pid)

        def held(n: int) -> Any:
            yield headers()
            yield body(completion([n, *range(1_000, 1_000_000)]), end=True)  # 7.9 MB
            release.wait(60)

        with grpc.insecure_channel(target) as channel:
            stub = ExternalProcessorStub(channel)
            streams = []
            for n in range(10):
                replies = stub.Process(held(n), timeout=60)
                for reply in replies:  # read up to the end of the echoed body
                    if reply.request_body.response.body_mutation.streamed_response.end_of_stream:
                        break
                streams.append(replies)
            loads = api_call(server.port, "GET", "/loads")[1][0]["loads"]
            assert loads[0]["active_requests"] == 10
            grown = rss_bytes(server.proc.pid) - before
            assert grown < 350 << 20, grown / (1 << 20)  # 207 MB here; 580 MB with the parsed prompts
            release.set()
            for call in streams:
                call.cancel()
        assert api_call(server.port, "GET", "/health") == (200, {"status": "ok"})
    finally:
        release.set()
        server.stop()


def test_picker_connections_are_capped_and_silent_ones_time_out() -> None:
    """The picker had no cap on gRPC connections. Past `--max-connections` a new one is
    closed at once; a connection that never completes its HTTP/2 handshake is closed after
    `--request-timeout-secs`, its slot given back; HTTP answers throughout."""
    import socket
    import time

    from test_http import Server, api_call

    server = Server("--ext-proc-port", "0", "--max-connections", "4", "--request-timeout-secs", "1",
                    mode="approximate")
    try:
        host, port = server.ext_proc_url().removeprefix("grpc://").rsplit(":", 1)
        silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(6)]
        time.sleep(0.3)
        states = []
        for sock in silent:
            sock.settimeout(0.3)
            try:
                states.append("settings" if sock.recv(9)[3:4] == b"\x04" else "closed")
            except TimeoutError:
                states.append("open")
        assert states == ["settings"] * 4 + ["closed"] * 2, states
        assert api_call(server.port, "GET", "/health") == (200, {"status": "ok"})
        for sock in silent[:4]:  # never a preface: closed once the handshake times out
            sock.settimeout(5)
            while sock.recv(65536):
                pass
        time.sleep(0.2)
        again = socket.create_connection((host, int(port)), timeout=5)
        assert again.recv(9)[3:4] == b"\x04"  # a slot again: the server's SETTINGS frame
        for sock in [*silent, again]:
            sock.close()
    finally:
        server.stop()


def _raw_call(port: int, path: str, data: bytes, content_type: bytes = b"application/grpc") -> dict[bytes, bytes]:
    """One call over a raw HTTP/2 connection (h2 as the client): its answer's headers and trailers."""
    import socket

    import h2.config
    import h2.connection
    import h2.events

    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
                                        (b":authority", b"picker"), (b"content-type", content_type),
                                        (b"te", b"trailers")])
        for start in range(0, len(data), 16_384):
            client.send_data(stream_id, data[start:start + 16_384])
        client.end_stream(stream_id)
        sock.sendall(client.data_to_send())
        fields: dict[bytes, bytes] = {}
        while True:
            chunk = sock.recv(65536)
            assert chunk, "closed without an answer"
            for event in client.receive_data(chunk):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    fields.update(dict(event.headers))
                if isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    return fields
            sock.sendall(client.data_to_send())


def test_the_pickers_wire_refuses_hostile_calls_and_serves_on() -> None:
    """Our gRPC server (adapters/grpc.py) over a real socket: a message over 16 MiB, a compressed
    message, a message cut short, an unknown method, a non-gRPC content type and a garbage
    preface are each refused with their status, book nothing, and the next call is served."""
    import socket

    from test_http import Server, api_call

    server = Server("--ext-proc-port", "0", mode="approximate")
    try:
        port = int(server.ext_proc_url().rsplit(":", 1)[1])
        assert api_call(server.port, "POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": 4,
                                                          "endpoint": "http://10.0.0.1:8000"})[0] == 201
        process = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
        over = _raw_call(port, process, (17 << 20).to_bytes(5, "big") + b"x" * 100)
        assert over[b"grpc-status"] == b"8" and b"over the limit" in over[b"grpc-message"]
        squeezed = _raw_call(port, process, b"\x01" + (3).to_bytes(4, "big") + b"abc")
        assert squeezed[b"grpc-status"] == b"12"
        cut = _raw_call(port, process, (100).to_bytes(5, "big") + b"short")
        assert cut[b"grpc-status"] == b"3"
        garbage = _raw_call(port, process, (4).to_bytes(5, "big") + b"\xff\xff\xff\xff")
        assert garbage[b"grpc-status"] == b"3"
        assert _raw_call(port, "/no.Such/Method", b"")[b"grpc-status"] == b"12"
        assert _raw_call(port, process, b"", content_type=b"text/plain")[b":status"] == b"415"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n" * 10)
            sock.settimeout(5)
            while sock.recv(65536):  # a GOAWAY, then closed
                pass
        message = ProcessingRequest(request_headers=HttpHeaders(end_of_stream=True)).SerializeToString()
        served = _raw_call(port, process, len(message).to_bytes(5, "big") + message)
        assert served[b"grpc-status"] == b"0"
        assert api_call(server.port, "GET", "/loads")[1][0]["loads"][0]["active_requests"] == 0
        assert api_call(server.port, "GET", "/health") == (200, {"status": "ok"})
    finally:
        server.stop()


def test_many_interleaved_streams_on_one_connection_end_every_way_and_leak_nothing() -> None:
    """The picker runs each call's messages in the connection reader's turn. Forty-eight streams
    on one raw HTTP/2 connection, their messages interleaved, end every way: reset before the body
    is whole, reset after being routed (a client leaving mid-response), half-closed after being
    routed, and answered with a bad message. Each routed one got its destination; afterwards no
    booking is left, and as many new streams as the cap allows are each taken (none counted twice
    or leaked)."""
    import socket
    import time

    import h2.config
    import h2.connection
    import h2.errors
    import h2.events
    from test_http import Server, api_call

    cap = 60
    server = Server("--ext-proc-port", "0", "--max-connections", str(cap), mode="approximate")
    try:
        port = int(server.ext_proc_url().rsplit(":", 1)[1])
        assert api_call(server.port, "POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": 4,
                                                          "endpoint": "http://10.0.0.1:8000"})[0] == 201
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        client.initiate_connection()

        def framed(message: ProcessingRequest) -> bytes:
            payload = message.SerializeToString()
            return len(payload).to_bytes(5, "big") + payload

        def open_call() -> int:
            stream_id = client.get_next_available_stream_id()
            client.send_headers(stream_id, [
                (b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"picker"),
                (b":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
                (b"content-type", b"application/grpc"), (b"te", b"trailers")])
            return stream_id

        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            answers: dict[int, list[Any]] = {}

            def exchange(until: Any) -> None:
                sock.sendall(client.data_to_send())
                while not until():
                    chunk = sock.recv(65536)
                    assert chunk, "the picker closed the connection"
                    for event in client.receive_data(chunk):
                        if isinstance(event, h2.events.DataReceived):
                            client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                        if getattr(event, "stream_id", None):
                            answers.setdefault(event.stream_id, []).append(event)
                    sock.sendall(client.data_to_send())

            raw = completion(list(range(64)))
            calls = [open_call() for _ in range(48)]
            for stream_id in calls:
                client.send_data(stream_id, framed(headers()))
            for stream_id in calls:  # half a body each, all interleaved
                client.send_data(stream_id, framed(body(raw[:40])))
            exchange(lambda: True)
            for n, stream_id in enumerate(calls):
                if n % 4 == 0:
                    client.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
                elif n % 4 == 3:
                    client.send_data(stream_id, b"\x00\x00\x00\x00\x04\xff\xff\xff\xff", end_stream=True)
                else:
                    client.send_data(stream_id, framed(body(raw[40:], end=True)))
            routed = [s for n, s in enumerate(calls) if n % 4 in (1, 2)]

            def replied(stream_id: int) -> bool:
                return any(isinstance(e, h2.events.DataReceived) for e in answers.get(stream_id, []))

            def status(stream_id: int) -> bytes | None:
                for event in answers.get(stream_id, []):  # trailers, or a trailers-only answer
                    if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                        if (code := dict(event.headers).get(b"grpc-status")) is not None:
                            return code
                return None

            exchange(lambda: all(replied(s) for s in routed)
                     and all(status(s) is not None for n, s in enumerate(calls) if n % 4 == 3))
            assert all(status(s) == b"3" for n, s in enumerate(calls) if n % 4 == 3)  # INVALID_ARGUMENT
            for n, stream_id in enumerate(calls):
                if n % 4 == 1:
                    client.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
                elif n % 4 == 2:
                    client.end_stream(stream_id)
            exchange(lambda: all(status(s) == b"0" for n, s in enumerate(calls) if n % 4 == 2))

            def booked() -> int:
                return int(api_call(server.port, "GET", "/loads")[1][0]["loads"][0]["active_requests"])

            deadline = time.monotonic() + 10
            while booked() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert booked() == 0
            # The cap's every slot is free again: `cap` new streams are all taken and held.
            held = [open_call() for _ in range(cap)]
            for stream_id in held:
                client.send_data(stream_id, framed(headers()))
            sock.sendall(client.data_to_send())
            sock.settimeout(1.0)
            try:
                exchange(lambda: any(status(s) is not None for s in held))
            except TimeoutError:
                pass  # nothing answered within a second: every stream was taken and is waiting
            assert [s for s in held if status(s) is not None] == []
        assert api_call(server.port, "GET", "/health") == (200, {"status": "ok"})
    finally:
        server.stop()


def test_picker_streams_waiting_in_the_queue_can_leave_and_the_rest_are_served_in_turn() -> None:
    """Queueing on and the only engine busy: a small and a large (over 64 KiB: read in a worker
    thread) request wait in the queue through the picker. The small one's client leaves: its
    queued selection goes with it. Once the engine's booking ends, the large one is routed; in the
    end nothing is booked or queued."""
    import http.client
    import threading
    import time

    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from test_http import Server, api_call

    def pending() -> float:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("selection_proto_queue_pending{"))

    def until(condition: Any) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.05)

    server = Server("--ext-proc-port", "0", "--queue-threshold", "0.5", "--queue-max-pending", "4",
                    mode="approximate")
    release = threading.Event()
    try:
        assert api_call(server.port, "POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": 4,
                                                          "endpoint": "http://10.0.0.1:8000",
                                                          "max_num_batched_tokens": 16})[0] == 201
        status, busy = api_call(server.port, "POST", "/select_and_reserve",
                                {"model_name": "m", "token_ids": list(range(40))})
        assert status == 200, busy

        def held(prompt: list[int]) -> Any:
            yield headers()
            yield body(completion(prompt), end=True)
            release.wait(30)

        with grpc.insecure_channel(server.ext_proc_url().removeprefix("grpc://")) as channel:
            stub = ExternalProcessorStub(channel)
            small = stub.Process(held([7] * 40), timeout=30)
            large = stub.Process(held(list(range(100, 20_100))), timeout=30)  # ~110 KB of JSON
            until(lambda: pending() == 2)
            small.cancel()
            until(lambda: pending() == 1)
            rid = busy["reservation_id"]
            assert api_call(server.port, "DELETE", f"/reservations/{rid}?model_name=m&tenant_id=default")[0] == 200
            first = next(large)
            assert first.request_headers.response.header_mutation.set_headers[0].header.raw_value == b"10.0.0.1:8000"
            release.set()
            list(large)
        until(lambda: pending() == 0 and api_call(server.port, "GET", "/loads")[1][0]["loads"][0]["active_requests"] == 0)
        assert api_call(server.port, "GET", "/health") == (200, {"status": "ok"})
    finally:
        release.set()
        server.stop()


def test_health_checks_without_a_message_or_with_a_bad_one() -> None:
    """gRPC health over a raw HTTP/2 call: no request message at all reads as the default service
    (SERVING), bytes that are not a HealthCheckRequest are INVALID_ARGUMENT."""
    from grpc_health.v1 import health_pb2
    from test_http import Server

    server = Server("--ext-proc-port", "0", mode="approximate")
    try:
        port = int(server.ext_proc_url().rsplit(":", 1)[1])
        check = "/grpc.health.v1.Health/Check"
        empty = _raw_call(port, check, b"")
        assert empty[b"grpc-status"] == b"0"
        bad = _raw_call(port, check, (4).to_bytes(5, "big") + b"\xff\xff\xff\xff")
        assert bad[b"grpc-status"] == b"3" and b"HealthCheckRequest" in bad[b"grpc-message"]
        named = health_pb2.HealthCheckRequest(service="readiness").SerializeToString()
        assert _raw_call(port, check, len(named).to_bytes(5, "big") + named)[b"grpc-status"] == b"0"
    finally:
        server.stop()


@pytest.mark.parametrize("backend", ["asyncio", "uvloop"])
def test_the_pickers_loop_streams_read_ahead_a_bounded_amount_and_end_cleanly(backend: str) -> None:
    """transports/loop_stream.py over a real socket: while its reader does not read, a stream
    holds at most READ_AHEAD (plus one read) and the sender is held back by TCP; then every byte
    arrives in order, the end reads as EndOfStream, and writes to a peer gone raise
    BrokenResourceError, never hang."""
    import anyio

    from selection_proto.transports.loop_stream import READ_AHEAD, LoopListener

    sent = bytes(range(256)) * (4 * 4096)  # 4 MiB
    outcome: dict[str, Any] = {}

    async def main() -> None:
        listener = await LoopListener.bind("127.0.0.1", 0, reuse_port=False, tls=None, handshake_timeout=5)
        reading = anyio.Event()
        done = anyio.Event()

        async def handler(stream: Any) -> None:
            await reading.wait()
            outcome["held"] = stream._buffered
            got = bytearray()
            with pytest.raises(anyio.EndOfStream):
                while True:
                    got += await stream.receive()
            outcome["got"] = bytes(got)
            with pytest.raises(anyio.BrokenResourceError):
                for _ in range(1000):  # the peer is gone: a write fails at once or soon after
                    await stream.send(b"x" * 65536)
                    await anyio.sleep(0.001)
            done.set()

        async with anyio.create_task_group() as group:
            group.start_soon(listener.serve, handler, lambda exc: None, lambda: True, lambda: None)
            client = await anyio.connect_tcp("127.0.0.1", listener.port)

            async def push() -> None:
                await client.send(sent)
                await client.send_eof()

            group.start_soon(push)
            await anyio.sleep(0.5)  # the client sends as far as the buffers let it
            reading.set()
            with anyio.fail_after(10):
                while "got" not in outcome:
                    await anyio.sleep(0.01)
            await client.aclose()
            with anyio.fail_after(10):
                await done.wait()
            group.cancel_scope.cancel()

    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": backend == "uvloop"})
    assert outcome["held"] <= READ_AHEAD + 65536 * 4
    assert outcome["got"] == sent


def test_the_pickers_http2_refuses_broken_frames_over_a_socket_and_serves_on() -> None:
    """Our HTTP/2 (adapters/http2.py) over a real socket: a header block kept open by empty
    CONTINUATIONs and an oversized frame each end their connection with GOAWAY (ENHANCE_YOUR_CALM,
    FRAME_SIZE_ERROR); a malformed request's stream is reset PROTOCOL_ERROR while its connection
    stays up; afterwards a call is served and `/health` answers."""
    import socket

    import hpack
    from hyperframe.frame import (
        ContinuationFrame,
        Frame,
        GoAwayFrame,
        HeadersFrame,
        RstStreamFrame,
        SettingsFrame,
    )
    from test_http import Server, api_call

    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize()
    process = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    request = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", process), (b"content-type", b"application/grpc")]

    def frames_answered(port: int, data: bytes, until_closed: bool) -> list[Any]:
        got, answered = b"", []
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(preface + data)
            sock.settimeout(2 if not until_closed else 10)
            try:
                while chunk := sock.recv(65536):
                    got += chunk
            except TimeoutError:
                pass
        while len(got) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(got[:9]))
            frame.parse_body(memoryview(got[9:9 + length]))
            answered.append(frame)
            got = got[9 + length:]
        return answered

    server = Server("--ext-proc-port", "0", mode="approximate")
    try:
        port = int(server.ext_proc_url().rsplit(":", 1)[1])
        block = hpack.Encoder().encode(request)
        flood = HeadersFrame(1, block[:2]).serialize() + ContinuationFrame(1, b"").serialize() * 200
        assert [f.error_code for f in frames_answered(port, flood, True) if isinstance(f, GoAwayFrame)] == [11]
        oversized = (20_000).to_bytes(3, "big") + b"\x00\x00\x00\x00\x00\x01" + b"\x00" * 20_000
        assert [f.error_code for f in frames_answered(port, oversized, True) if isinstance(f, GoAwayFrame)] == [6]
        malformed = HeadersFrame(1, hpack.Encoder().encode([*request, (b"Upper", b"x")]),
                                 flags={"END_HEADERS"}).serialize()
        answered = frames_answered(port, malformed, False)
        assert [(type(f), f.error_code) for f in answered if isinstance(f, (RstStreamFrame, GoAwayFrame))] == [
            (RstStreamFrame, 1)]
        message = ProcessingRequest(request_headers=HttpHeaders(end_of_stream=True)).SerializeToString()
        assert api_call(server.port, "POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": 4,
                                                          "endpoint": "http://10.0.0.1:8000"})[0] == 201
        served = _raw_call(port, process.decode(), len(message).to_bytes(5, "big") + message)
        assert served[b"grpc-status"] == b"0"
        assert api_call(server.port, "GET", "/health") == (200, {"status": "ok"})
    finally:
        server.stop()
