"""Where one HTTP `/select` request spends its time, in process (no sockets, no wrk):

* `adapter`: the whole `HttpConnection` round (h11 parse, `handle`, answer bytes);
* `handle`, and inside it `decode` (JSON syntax), `shape` (typed request), `select`;
* `bare h11`: the same request bytes through a bare h11 connection answering `200 {}`;
* the JSON floor: other ways to read the same `token_ids` (those installed are timed);
* with `--offload`: decode and shape in a worker process (`anyio.to_process`), the CPU that
  costs the serving process and the wall time per request.

    python bench/request_path.py [--requests 400] [--offload]

Rounds interleave the phases so that all of them see the same cache and allocator state;
figures are the minimum and the median in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from array import array
from collections.abc import Callable

import h11

sys.path.insert(0, os.path.dirname(__file__))
from workload import BLOCK_SIZE, WORKERS, prompts  # noqa: E402

from selection_proto import SelectionService, SelectRequest, Settings, WorkerRequest  # noqa: E402
from selection_proto.adapters.http import HttpConnection  # noqa: E402
from selection_proto.core.base import jsonio  # noqa: E402
from selection_proto.core.base.codec import ShapeContext, from_json  # noqa: E402

HEADERS = [("host", "127.0.0.1"), ("content-type", "application/json")]


def service() -> SelectionService:
    svc = SelectionService(Settings(kv_events="push"), random.Random(0))
    for w in range(WORKERS):
        svc.upsert_worker(WorkerRequest(worker_id=w, model_name="m", endpoint=f"http://w{w}",
                                        block_size=BLOCK_SIZE), now=0.0)
    return svc


def request_bytes(body: bytes) -> bytes:
    head = "".join(f"{n}: {v}\r\n" for n, v in HEADERS)
    return f"POST /select HTTP/1.1\r\n{head}content-length: {len(body)}\r\n\r\n".encode() + body


def bare_round(conn: h11.Connection, chunks: list[bytes]) -> None:
    for chunk in chunks:
        conn.receive_data(chunk)
    while not isinstance(conn.next_event(), h11.EndOfMessage):
        pass
    conn.send(h11.Response(status_code=200, headers=[("content-type", "application/json"),
                                                     ("content-length", "2")]))
    conn.send(h11.Data(data=b"{}"))
    conn.send(h11.EndOfMessage())
    conn.start_next_cycle()


def floors(body: bytes, tokens: list[int]) -> dict[str, Callable[[], object]]:
    """Ways to turn the JSON body into u32 token ids (each result is dropped: freeing counts)."""
    import orjson

    def orjson_array() -> object:
        packed = array("I")
        packed.fromlist(orjson.loads(body)["token_ids"])
        return packed

    found: dict[str, Callable[[], object]] = {
        "orjson.loads": lambda: orjson.loads(body),
        "orjson.loads + array.fromlist": orjson_array,
        "json.loads (stdlib)": lambda: json.loads(body),
    }
    text = orjson.dumps(tokens)
    try:
        import simdjson  # type: ignore[import-not-found]

        parser = simdjson.Parser()

        def simd() -> object:
            wide = array("I")
            wide.frombytes(parser.parse(text).as_buffer(of_type="u"))
            return wide[::2]

        found["pysimdjson parse + as_buffer (token array only)"] = simd

        def simd_body() -> object:
            # A whole fast path: cut the one array out of the body, orjson for the rest.
            start, end = body.index(b"["), body.index(b"]")
            rest = orjson.loads(body[:start] + b"0" + body[end + 1:])
            wide = array("I")
            wide.frombytes(parser.parse(body[start:end + 1]).as_buffer(of_type="u"))
            rest["token_ids"] = wide[::2]
            return rest

        found["pysimdjson fast path (whole body: slice + orjson rest)"] = simd_body
    except ImportError:
        pass
    try:
        import numpy

        found["numpy.fromstring (token array only)"] = lambda: numpy.fromstring(
            text[1:-1], dtype=numpy.uint32, sep=",")
    except ImportError:
        pass
    return found


def decode_request(body: bytes) -> SelectRequest:
    """Decode and shape, as `handle` does; module-level so a worker process can import it."""
    return from_json(SelectRequest, jsonio.loads(body), "", ShapeContext(may_contain_bools=False))


async def offload(body: bytes, count: int) -> tuple[list[float], list[float]]:
    import anyio.to_process

    await anyio.to_process.run_sync(decode_request, body)  # start the worker
    wall, cpu = [], []
    for _ in range(count):
        start, used = time.perf_counter(), time.process_time()
        await anyio.to_process.run_sync(decode_request, body)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - used)
    return wall, cpu


def measure(tokens: int, count: int, with_offload: bool) -> None:
    svc = service()
    prompt = prompts(tokens, 1)[0]
    body = json.dumps({"model_name": "m", "token_ids": prompt}).encode()
    raw = request_bytes(body)
    chunks = [raw[i:i + 65536] for i in range(0, len(raw), 65536)]
    conn = HttpConnection(svc, time.monotonic)
    bare = h11.Connection(h11.SERVER)
    headers = [*HEADERS, ("content-length", str(len(body)))]
    ctx = ShapeContext(may_contain_bools=False)

    def adapter() -> None:
        for chunk in chunks:
            conn.receive_data(chunk)
        while conn.data_to_send():
            pass

    state: dict[str, object] = {}

    def decode() -> None:
        state["value"] = jsonio.loads(body)

    def shape() -> None:
        state["request"] = from_json(SelectRequest, state.pop("value"), "", ctx)

    def select() -> None:
        svc.select(state.pop("request"), now=1.0)  # type: ignore[arg-type]

    phases: dict[str, Callable[[], object]] = {
        "adapter (h11 + handle + answer)": adapter,
        "handle": lambda: svc.handle("POST", "/select", "", headers, body, now=1.0),
        "  decode (jsonio.loads)": decode,
        "  shape (from_json)": shape,
        "  select (hash, lookup, score)": select,
        "bare h11 (200 {})": lambda: bare_round(bare, chunks),
        **floors(body, prompt),
    }
    times: dict[str, list[float]] = {name: [] for name in phases}
    clock = time.perf_counter
    for _ in range(count):
        for name, fn in phases.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    print(f"\n{tokens} tokens ({len(body):,} byte body), {count} rounds, µs: min / median")
    if with_offload:
        import anyio

        # process_time ticks coarsely: the mean over all calls is the serving process's cost.
        wall, cpu = anyio.run(offload, body, count)
        times["offloaded decode + shape: wall"] = wall
        times["offloaded decode + shape: serving CPU (mean)"] = [statistics.mean(cpu)]
    for name, ts in times.items():
        print(f"  {name:<52}{min(ts) * 1e6:>8.0f}{statistics.median(ts) * 1e6:>8.0f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--offload", action="store_true")
    args = parser.parse_args()
    for tokens in (1024, 16384):
        measure(tokens, args.requests * (4 if tokens == 1024 else 1), args.offload)


if __name__ == "__main__":
    main()
