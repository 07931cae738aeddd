"""`selection-proto stdio` as a real subprocess, and the Sans-IO session directly."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from typing import Any

from conftest import worker

from selection_proto import SelectionService, Settings
from selection_proto.adapters.jsonl import MAX_LINE, JsonRpcSession


def rpc(rid: Any, method: str, **params: Any) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
    if rid is not None:
        message["id"] = rid
    return json.dumps(message).encode() + b"\n"


def run_session(data: bytes, *args: str, timeout: float = 60) -> tuple[list[dict[str, Any]], str, int]:
    proc = subprocess.run([sys.executable, "-m", "selection_proto", "stdio", "--kv-events", "push", *args],
                          input=data, capture_output=True, timeout=timeout)
    lines = proc.stdout.decode().splitlines()
    return [json.loads(line) for line in lines], proc.stderr.decode(), proc.returncode


def test_whole_session_with_bad_lines() -> None:
    data = b"".join([
        rpc(1, "workers.create", **worker(1)),
        b"this is not json\n",
        b"   \t \r\n",
        b"[1, 2]\n",
        b'"text"\n',
        b'{"jsonrpc": "1.0", "id": 7, "method": "health"}\n',
        b'{"jsonrpc": "2.0", "id": [1], "method": "health"}\n',
        b'{"jsonrpc": "2.0", "id": 8, "method": "health", "params": [1]}\n',
        rpc(2, "select", model_name="m", token_ids=[1, 2, 3, 4]),
        rpc(3, "workers.delete", worker_id=9),
        rpc(None, "workers.create", **worker(2)),  # a notification: processed, never answered
        rpc(None, "no.such.method"),
        rpc(4, "no.such.method"),
        rpc(5, "reservations.free", reservation_id="a/b"),
        rpc(6, "workers.update", worker_id=True),
        rpc(9, "ready"),
        rpc(10, "workers.list", model_name="m"),
        rpc(11, "kv_events", worker_id=1, events=[{"event_id": 1, "data": "cleared"}]),
        b'{"jsonrpc":"2.0","id":12,"method":"health"}',  # final line without newline
    ])
    answers, stderr, code = run_session(data)
    assert code == 0
    batches = [a for a in answers if isinstance(a, list)]
    answers = [a for a in answers if not isinstance(a, list)]
    by_id = {a["id"]: a for a in answers if a["id"] is not None}
    anonymous = [a["error"] for a in answers if a["id"] is None]
    assert [e["code"] for e in anonymous] == [-32700, -32600, -32600]
    # `[1, 2]` is a batch of two members that are not calls: one array of two errors.
    assert [[m["error"]["data"] for m in batch] for batch in batches] == [
        [{"detail": "a request must be a JSON object"}] * 2]
    assert by_id[1]["result"]["lifecycle"] == "schedulable"
    assert by_id[7]["error"]["code"] == -32600
    assert by_id[8]["error"]["code"] == -32602
    assert by_id[2]["result"]["worker_id"] == 1
    assert by_id[3]["error"] == {"code": 404, "message": "worker 9 not found",
                                 "data": {"status": 404, "body": {"error": "worker 9 not found"}}}
    assert by_id[4]["error"] == {"code": -32601, "message": "Method not found", "data": {"method": "no.such.method"}}
    assert by_id[5]["error"]["message"] == "reservation a/b not found"
    assert by_id[6]["error"] == {"code": -32602, "message": "Invalid params",
                                 "data": {"detail": "worker_id must be an integer"}}
    assert by_id[9]["result"]["schedulable_workers"] == 2
    assert [w["worker_id"] for w in by_id[10]["result"]] == [1, 2]
    assert by_id[11]["result"]["applied"] == 1
    assert by_id[12]["result"] == {"status": "ok"}
    assert len(answers) == 15
    for line in stderr.splitlines():
        assert "level" in json.loads(line)


def test_over_long_line_is_answered_and_the_stream_resyncs() -> None:
    data = b'{"jsonrpc":"2.0","id":1,"method":"health","junk":"' + b"x" * (MAX_LINE + 10) + b'"}\n' + rpc(2, "health")
    answers, _, code = run_session(data)
    assert code == 0
    assert answers == [
        {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "Invalid Request",
                                                 "data": {"detail": "line exceeds 8388608 bytes"}}},
        {"jsonrpc": "2.0", "id": 2, "result": {"status": "ok"}}]


def test_queued_answers_overtake_and_eof_answers_what_waits() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "stdio", "--kv-events", "push",
                             "--queue-threshold", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None

    def send(data: bytes) -> None:
        assert proc.stdin is not None
        proc.stdin.write(data)
        proc.stdin.flush()

    def answer() -> dict[str, Any]:
        assert proc.stdout is not None
        return json.loads(proc.stdout.readline())

    send(rpc(1, "workers.create", **worker(1, max_num_batched_tokens=8)))
    assert answer()["id"] == 1
    send(rpc(2, "reservations.create", model_name="m", reservation_id="hold", worker_id=1,
             token_ids=list(range(16))))
    assert answer()["id"] == 2
    send(rpc("q", "select", model_name="m", token_ids=[1, 2, 3, 4]))
    send(rpc("q", "select", model_name="m", token_ids=[1, 2, 3, 4]))
    assert answer() == {"jsonrpc": "2.0", "id": "q", "error": {
        "code": -32600, "message": "Invalid Request", "data": {"detail": "id q is already in flight"}}}
    send(rpc("gone", "select", model_name="m", token_ids=[1, 2, 3, 4]))
    send(rpc(None, "cancel", id="gone"))
    send(rpc(3, "loads"))
    loads = answer()
    assert loads["id"] == 3 and loads["result"][0]["pending_count"] == 1  # "gone" was cancelled
    send(rpc(4, "reservations.free", reservation_id="hold"))
    first, second = answer(), answer()
    assert {first["id"], second["id"]} == {"q", 4}  # the deferred answer may come first
    send(rpc(5, "reservations.create", model_name="m", reservation_id="hold", worker_id=1,
             token_ids=list(range(16))))
    assert answer()["id"] == 5
    send(rpc("late", "select", model_name="m", token_ids=[1]))
    time.sleep(0.2)
    proc.stdin.close()
    last = answer()
    assert last["id"] == "late" and last["error"]["message"] == "selection service is shutting down"
    assert proc.wait(timeout=30) == 0


def test_same_bytes_over_http_jsonl_and_in_process() -> None:
    def fresh() -> SelectionService:
        return SelectionService(Settings(kv_events="push"), random.Random(5))

    body = {"model_name": "m", "token_ids": list(range(12)), "explain": True}
    direct = fresh()
    direct.handle("POST", "/workers", "", [("content-type", "application/json")],
                  json.dumps(worker(1)).encode(), now=0.0)
    http_body = direct.handle("POST", "/select_and_reserve", "", [("content-type", "application/json")],
                              json.dumps(body).encode(), now=0.0).body
    session_service = fresh()
    session = JsonRpcSession(session_service, lambda: 0.0)
    session.receive_data(rpc(1, "workers.create", **worker(1)) + rpc(2, "select_and_reserve", **body))
    lines = session.data_to_send().splitlines()
    assert lines[1] == b'{"jsonrpc":"2.0","id":2,"result":' + http_body + b"}"
    typed = fresh()
    from selection_proto import SelectAndReserveRequest, WorkerRequest

    typed.upsert_worker(WorkerRequest(**worker(1)), now=0.0)
    answer = typed.select_and_reserve(SelectAndReserveRequest(**body), now=0.0)
    assert json.dumps(answer.to_json(), separators=(",", ":")).encode() == http_body


def test_settings_from_file_environment_and_flags(tmp_path: Any) -> None:
    import os

    config = tmp_path / "settings.toml"
    config.write_text('kv_events = "push"\nqueue_threshold = 2.0\n')
    create = rpc(1, "workers.create", **worker(1)) + rpc(2, "kv_events", worker_id=1, events=[])

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([sys.executable, "-m", "selection_proto", "stdio", *args], input=create,
                              capture_output=True, timeout=60, env={**os.environ, **env})

    answers = [json.loads(line) for line in run("--config", str(config)).stdout.splitlines()]
    # queue_threshold from the file makes max_num_batched_tokens required; kv_events=push accepts events
    assert answers[0]["result"]["not_schedulable_reasons"] == [
        "max_num_batched_tokens is required while queueing is enabled"]
    assert answers[1]["error"]["message"] == "worker 1 is not schedulable"
    answers = [json.loads(line) for line in run("--config", str(config), "--queue-threshold", "none",
                                                SELECTION_PROTO_KV_EVENTS="off").stdout.splitlines()]
    assert answers[0]["result"]["lifecycle"] == "schedulable"  # the flag wins over the file
    assert answers[1]["error"]["message"] == "kv events are disabled (kv_events=off)"  # env over file
    config.write_text("frob = 1\n")
    result = run("--config", str(config))
    assert result.returncode == 2
    assert result.stderr.decode().strip() == f"selection-proto: error: --config {config}: unknown setting 'frob'"


def test_kv_events_notifications_and_msgpack_batches() -> None:
    import base64

    import msgpack

    batch = msgpack.packb([0.0, [["BlockStored", [5, 6], None, list(range(1, 9)), 4, None, "GPU", None, None]], 0])
    data = b"".join([
        rpc(1, "workers.create", **worker(1)),
        rpc(None, "kv_events", worker_id=1, batch_b64=base64.b64encode(batch).decode()),  # a notification
        rpc(2, "overlap_scores", model_name="m", token_ids=list(range(1, 9))),
        rpc(3, "kv_events", worker_id=1, batch_b64="***"),
    ])
    answers, _, code = run_session(data)
    assert code == 0
    by_id = {a["id"]: a for a in answers}
    assert set(by_id) == {1, 2, 3}
    assert by_id[2]["result"]["workers"][0]["device_blocks"] == 2
    assert by_id[3]["error"] == {"code": -32602, "message": "Invalid params", "data": {"detail": "batch_b64 must be base64"}}


def test_shape_errors_match_http_for_values_the_fast_parser_cannot_hold() -> None:
    """JSON lines hand the parsed params to the core without encoding them again; integers beyond
    64 bits, bools among tokens and floats for integers still answer HTTP's status and text."""
    bad_bodies = [
        {"model_name": "m", "token_ids": [1, 18446744073709551616]},
        {"model_name": "m", "token_ids": [1, 2**80]},
        {"model_name": "m", "token_ids": [1, True]},
        {"model_name": "m", "token_ids": [1, 2.5]},
        {"model_name": "m", "token_ids": [1, 2], "allowed_worker_ids": [-1]},
        {"model_name": "m", "block_hashes": [2**64], "sequence_hashes": [1], "isl_tokens": 4},
    ]
    service = SelectionService(Settings(kv_events="push"), random.Random(5))
    service.handle("POST", "/workers", "", [("content-type", "application/json")],
                   json.dumps(worker(1)).encode(), now=0.0)
    session = JsonRpcSession(service, lambda: 0.0)
    for i, body in enumerate(bad_bodies):
        http = service.handle("POST", "/select", "", [("content-type", "application/json")],
                              json.dumps(body).encode(), now=0.0)
        session.receive_data(rpc(i, "select", **body))
        answer = json.loads(session.data_to_send())
        assert http.status == 422, (body, http)
        assert answer["error"]["code"] == 422
        assert answer["error"]["message"] == json.loads(http.body)["error"], body
    events = [{"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {
        "parent_hash": None, "blocks": [{"block_hash": 2**65, "tokens_hash": 1}]}}}}]
    http = service.handle("POST", "/kv_events", "", [("content-type", "application/json")],
                          json.dumps(events).encode(), now=0.0)
    session.receive_data(rpc(99, "kv_events", events=events))
    answer = json.loads(session.data_to_send())
    assert (answer["error"]["code"], answer["error"]["message"]) == (http.status, json.loads(http.body)["error"])


def test_kv_events_applied_in_steps_are_answered_over_json_rpc() -> None:
    events = [{"worker_id": 1, "event": {"event_id": i + 1, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": i, "tokens_hash": i}]}}}} for i in range(50)]
    answers, stderr, code = run_session(
        rpc(1, "workers.create", **worker(1)) + rpc(2, "kv_events", events=events) + rpc(3, "health"),
        "--max-events-per-step", "10")
    assert code == 0, stderr
    by_id = {a["id"]: a for a in answers}
    assert by_id[2]["result"] == {"received": 50, "applied": 50, "failed": 0, "dropped": 0, "failures": []}
    assert by_id[3]["result"] == {"status": "ok"}


def test_1_6_1_calls_over_json_rpc() -> None:
    """The new routes and members through a real `stdio` subprocess: a pending selection booked by
    `reservations.create`, an output block, and a session bound by a booking."""
    data = b"".join([
        rpc(1, "workers.create", **worker(1)),
        rpc(2, "select", model_name="m", selection_id="s", session_id="S", token_ids=list(range(8))),
        rpc(3, "reservations.create", model_name="m", selection_id="s"),
        rpc(4, "reservations.output_block", reservation_id="s", decay_fraction=0.5),
        rpc(5, "loads", model_name="m"),
        rpc(6, "reservations.output_block", reservation_id="s", decay_fraction=2),
    ])
    answers, _, code = run_session(data, "--session-affinity-ttl-secs", "30")
    assert code == 0
    by_id = {a["id"]: a for a in answers}
    assert by_id[3]["result"]["selection_id"] == "s" and by_id[3]["result"]["routing_group"] == "default"
    assert by_id[4]["result"] == {"status": "ok"}
    assert by_id[5]["result"][0]["loads"][0]["potential_decode_blocks"] == 2  # 2 x 0.5 + 1 x 0.5, rounded
    assert by_id[6]["error"]["code"] == 400
    assert by_id[6]["error"]["message"] == "decay_fraction must be between 0.0 and 1.0"


def test_batches_are_answered_as_one_array() -> None:
    """JSON-RPC 2.0 §6: a batch gets one array of the answers of its calls (notifications add
    none, a batch of notifications gets nothing); an empty batch is one Invalid Request; a member
    that is not a call gets its own error inside the array."""
    calls = [
        {"jsonrpc": "2.0", "id": 1, "method": "workers.create", "params": worker(1)},
        {"jsonrpc": "2.0", "method": "health"},
        {"jsonrpc": "2.0", "id": 2, "method": "nope"},
        5,
        {"jsonrpc": "2.0", "id": 3, "method": "loads", "params": {"model_name": "m"}},
    ]
    data = (json.dumps(calls) + "\n" + json.dumps([{"jsonrpc": "2.0", "method": "health"}]) + "\n[]\n").encode()
    answers, _, code = run_session(data)
    assert code == 0
    assert len(answers) == 2
    batch, empty = answers
    assert [a.get("id") for a in batch] == [1, 2, None, 3]
    assert batch[0]["result"]["lifecycle"] == "schedulable"
    assert batch[1]["error"]["code"] == -32601 and batch[2]["error"]["code"] == -32600
    assert batch[3]["result"][0]["loads"][0]["worker_id"] == 1
    assert empty["error"] == {"code": -32600, "message": "Invalid Request", "data": {"detail": "an empty batch"}}


def test_a_batch_waits_for_its_queued_selection() -> None:
    from selection_proto import SelectionReady, SelectionService, Settings

    service = SelectionService(Settings(kv_events="push", queue_threshold=0.5), random.Random(0))
    session = JsonRpcSession(service, lambda: 0.0)
    busy = {**worker(1), "max_num_batched_tokens": 8}
    session.receive_data(rpc(1, "workers.create", **busy) + rpc(
        2, "reservations.create", model_name="m", reservation_id="load", worker_id=1, token_ids=list(range(16))))
    session.data_to_send()
    batch = [{"jsonrpc": "2.0", "id": 3, "method": "select", "params": {"model_name": "m", "token_ids": [1, 2]}},
             {"jsonrpc": "2.0", "id": 4, "method": "health"}]
    session.receive_data(json.dumps(batch).encode() + b"\n")
    assert session.data_to_send() == b""  # the queued selection holds the batch's answer
    service.free("load", now=1.0)
    while (out := service.next_output()) is not None:
        if isinstance(out, SelectionReady):
            session.deliver(out)
    answer = json.loads(session.data_to_send())
    assert [a["id"] for a in answer] == [4, 3] and answer[1]["result"]["worker_id"] == 1


def test_every_method_is_documented() -> None:
    from pathlib import Path

    from selection_proto.adapters.jsonl import METHODS

    text = (Path(__file__).resolve().parent.parent / "docs" / "embedding.md").read_text()
    assert [m for m in (*METHODS, "cancel", "shutdown") if f"| `{m}` |" not in text] == []


def test_a_cancel_whose_id_is_not_an_id_is_invalid_params_and_the_process_answers_on() -> None:
    """A list or an object as `params.id` is -32602, not an internal error."""
    lines = b"".join([rpc(1, "cancel", id=[1, 2]), rpc(2, "cancel", id={"a": 1}), rpc(None, "cancel", id=[3]),
                      rpc(3, "cancel", id="nothing-waits"), rpc(4, "health")])
    answers, _, code = run_session(lines)
    assert code == 0
    by_id = {a.get("id"): a for a in answers}
    for rid in (1, 2):
        assert by_id[rid]["error"] == {"code": -32602, "message": "Invalid params",
                                       "data": {"detail": "params.id must be a string, a number or null"}}
    assert 3 not in by_id  # a cancel is answered only when it fails
    assert by_id[4]["result"] == {"status": "ok"}
    assert len(answers) == 3  # the notification got nothing
