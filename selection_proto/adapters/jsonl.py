"""Sans-IO JSON-RPC 2.0 over newline-delimited JSON, dispatching to the core's `handle` (transports.md §6).

Feed input bytes with `receive_data` (and `end_of_input` at EOF), hand the core's `SelectionReady`
outputs to `deliver`, and write what `data_to_send` returns. Results are the very bytes `handle`
produced, spliced into the envelope, so JSON lines and HTTP answer identically.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from functools import partial
from http import HTTPStatus
from typing import Any, Final
from urllib.parse import quote, urlencode

from ..core.base import jsonio
from ..core.base.metrics import JSONRPC_MESSAGES, LIMIT_REJECTIONS
from ..core.base.outputs import SelectionReady
from ..core.base.responses import Pending
from ..core.base.routes import EVENT_QUERY, ROUTES, ParsedBody, path_parameter
from ..core.base.wire import Response
from ..core.service import SelectionService

__all__ = ["MAX_LINE", "METHODS", "JsonRpcSession"]

MAX_LINE: Final = 8 * 1024 * 1024
_JSON: Final = ("content-type", "application/json")
_MSGPACK: Final = ("content-type", "application/msgpack")

# method -> (HTTP method, route template, path parameter, has body), from the route table
METHODS: Final[dict[str, tuple[str, str, str | None, bool]]] = {
    r.rpc: (r.method, r.template.replace("{" + (path_parameter(r.template) or "") + "}", "{}"),
            path_parameter(r.template), r.body)
    for r in ROUTES if r.rpc is not None}

Id = str | int | None


class _ParamsError(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def _envelope_error(rid: Id, code: int, message: str, data: dict[str, Any] | None = None) -> bytes:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return jsonio.dumps({"jsonrpc": "2.0", "id": rid, "error": error}) + b"\n"


def render(rid: Id, response: Response) -> bytes:
    """The JSON-RPC answer for one `handle` response (transports.md §6.4)."""
    status, headers, body = response
    head = b'{"jsonrpc":"2.0","id":' + jsonio.dumps(rid)
    if dict(headers).get("content-type") != "application/json":
        body = jsonio.dumps({"content_type": dict(headers).get("content-type", ""),
                             "text": body.decode("utf-8")})
    if 200 <= status < 300:
        return head + b',"result":' + body + b"}\n"
    parsed = jsonio.loads_own(body) if body else None
    message = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(message, str):
        message = HTTPStatus(status).phrase
    data: dict[str, Any] = {"status": status, "body": parsed}
    if (retry_after := dict(headers).get("retry-after")) is not None:
        data["retry_after"] = int(retry_after)  # HTTP's Retry-After, in seconds
    return head + b',"error":' + jsonio.dumps({"code": status, "message": message, "data": data}) + b"}\n"


class _Batch:
    """A JSON-RPC batch being answered: its members' answers, sent as one array once the last
    (queued selections included) is in; notifications add nothing."""

    __slots__ = ("answers", "pending", "open")

    def __init__(self) -> None:
        self.answers: list[bytes] = []
        self.pending = 0  # members waiting for a queued answer
        self.open = True  # its members are still being read


class JsonRpcSession:
    def __init__(self, service: SelectionService, clock: Callable[[], float]) -> None:
        self._service = service
        self._clock = clock
        self._buffer = bytearray()
        self._discarding = False
        self._out: list[bytes] = []
        self._waiting: dict[int, Id] = {}  # ticket -> request id (None for a notification)
        self._in_flight: dict[Id, int] = {}  # request id -> ticket
        self._batch: _Batch | None = None  # the batch whose members are being read
        self._ticket_batch: dict[int, _Batch] = {}  # queued members of batches
        self.shutdown_requested = False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def data_to_send(self) -> bytes:
        data = b"".join(self._out)
        self._out.clear()
        return data

    def _emit(self, answer: bytes) -> None:
        """One answer line: straight out, or into the batch being read."""
        if self._batch is not None:
            self._batch.answers.append(answer.rstrip(b"\n"))
        else:
            self._out.append(answer)

    def _close_batch(self, batch: _Batch) -> None:
        if batch.answers:
            self._out.append(b"[" + b",".join(batch.answers) + b"]\n")

    def _count(self, outcome: str) -> None:
        self._service.observe(JSONRPC_MESSAGES, (outcome,), 1.0)

    # -- framing -------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end == -1:
                break
            piece = data[start:end]
            start = end + 1
            if self._discarding:
                self._discarding = False
                continue
            if len(self._buffer) + len(piece) > MAX_LINE:
                self._buffer.clear()
                self._too_long()
                continue
            line = bytes(self._buffer) + piece if self._buffer else piece
            self._buffer.clear()
            self._line(line)
        rest = data[start:]
        if self._discarding:
            return
        if len(self._buffer) + len(rest) > MAX_LINE:
            # Never buffer beyond the limit: answer now, drop bytes up to the next newline.
            self._buffer.clear()
            self._discarding = True
            self._too_long()
            return
        self._buffer += rest

    def end_of_input(self) -> None:
        if self._buffer and not self._discarding:
            line = bytes(self._buffer)
            self._buffer.clear()
            self._line(line)

    def _too_long(self) -> None:
        self._count("line_too_long")
        self._service.observe(LIMIT_REJECTIONS, ("line_size",), 1.0)
        self._out.append(_envelope_error(None, -32600, "Invalid Request",
                                         {"detail": f"line exceeds {MAX_LINE} bytes"}))

    # -- envelope ------------------------------------------------------------------------------

    def _line(self, line: bytes) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line.strip(b" \t"):
            return
        try:
            message, may_contain_bools = jsonio.loads_with_hints(line)
        except jsonio.JSONSyntaxError as exc:
            self._count("parse_error")
            self._out.append(_envelope_error(None, -32700, "Parse error", {"detail": exc.detail}))
            return
        if isinstance(message, list):
            if not message:
                self._invalid(None, "an empty batch")
                return
            batch = self._batch = _Batch()
            try:
                for i, member in enumerate(message):
                    self._message(member, partial(_exact_member, line, i), len(line), may_contain_bools)
            finally:
                self._batch = None
                batch.open = False
            if batch.pending == 0:
                self._close_batch(batch)
            return
        self._message(message, lambda: jsonio.loads_exact(line), len(line), may_contain_bools)

    def _message(self, message: Any, exact: Callable[[], Any], size: int, may_contain_bools: bool) -> None:
        """One call of a line (or of a batch); `exact` re-reads it with exact integers."""
        if not isinstance(message, dict):
            self._invalid(None, "a request must be a JSON object")
            return
        has_id = "id" in message
        rid = message.get("id")
        valid_id = isinstance(rid, (str, int)) and not isinstance(rid, bool)
        if has_id and not valid_id:
            self._invalid(None, "id must be a string or an integer")
            return
        method = message.get("method")
        if message.get("jsonrpc") != "2.0" or not isinstance(method, str):
            self._invalid(rid if has_id else None, "jsonrpc must be \"2.0\" and method a string")
            return
        params = message.get("params", {})
        if not isinstance(params, dict):
            self._count("invalid_params")
            if has_id:
                self._emit(_envelope_error(rid, -32602, "Invalid params",
                                           {"detail": "params must be an object"}))
            return
        if has_id and rid in self._in_flight:
            self._invalid(rid, f"id {rid} is already in flight")
            return
        self._count("request" if has_id else "notification")
        try:
            self._call(rid if has_id else None, has_id, method, params, exact, size, may_contain_bools)
        except Exception:  # noqa: BLE001 - one call's failure is confined to it
            self._service.internal_error("jsonrpc")
            self._count("internal_error")
            self._in_flight.pop(rid, None)
            if has_id:
                self._emit(_envelope_error(rid, -32603, "Internal error"))

    def _invalid(self, rid: Id, detail: str) -> None:
        self._count("invalid_request")
        self._emit(_envelope_error(rid, -32600, "Invalid Request", {"detail": detail}))

    # -- dispatch ------------------------------------------------------------------------------

    def _call(self, rid: Id, answer: bool, method: str, params: dict[str, Any], exact: Callable[[], Any],
              size: int, may_contain_bools: bool) -> None:
        if method == "cancel":
            target = params.get("id")
            if target is not None and not isinstance(target, (str, int, float)):  # not an id: unhashable too
                self._count("invalid_params")
                if answer:
                    self._emit(_envelope_error(rid, -32602, "Invalid params",
                                               {"detail": "params.id must be a string, a number or null"}))
                return
            ticket = None if isinstance(target, float) else self._in_flight.pop(target, None)
            if ticket is not None:
                self._waiting.pop(ticket, None)
                self._service.cancel(ticket, now=self._clock())
            return
        if method == "shutdown":
            self.shutdown_requested = True
            if answer:
                self._emit(b'{"jsonrpc":"2.0","id":' + jsonio.dumps(rid) + b',"result":{"status":"ok"}}\n')
            return
        route = METHODS.get(method)
        if route is None:
            self._count("method_not_found")
            if answer:
                self._emit(_envelope_error(rid, -32601, "Method not found", {"method": method}))
            return
        try:
            http_method, path, query, headers, body = _request(method, route, params, exact, size,
                                                               may_contain_bools)
        except _ParamsError as exc:
            self._count("invalid_params")
            if answer:
                self._emit(_envelope_error(rid, -32602, "Invalid params", {"detail": exc.detail}))
            return
        result = self._service.handle(http_method, path, query, headers, body, now=self._clock())
        if isinstance(result, Pending):
            self._waiting[result.ticket] = rid
            if answer:
                self._in_flight[rid] = result.ticket
                if self._batch is not None:  # the batch's answer waits for this one
                    self._ticket_batch[result.ticket] = self._batch
                    self._batch.pending += 1
            return
        if answer:
            self._emit(render(rid, result))

    def deliver(self, ready: SelectionReady) -> bool:
        """Write the deferred answer of one of this session's tickets; False if not ours."""
        if ready.ticket not in self._waiting:
            return False
        rid = self._waiting.pop(ready.ticket)
        batch = self._ticket_batch.pop(ready.ticket, None)
        if rid is not None and self._in_flight.get(rid) == ready.ticket:
            del self._in_flight[rid]
            answer = render(rid, ready.response)
            if batch is None:
                self._out.append(answer)
            else:
                batch.answers.append(answer.rstrip(b"\n"))
        if batch is not None:
            batch.pending -= 1
            if batch.pending == 0 and not batch.open:
                self._close_batch(batch)
        return True


def _exact_member(line: bytes, i: int) -> Any:
    return jsonio.loads_exact(line)[i]


def _request(method: str, route: tuple[str, str, str | None, bool], params: dict[str, Any],
             exact_call: Callable[[], Any], size: int, may_contain_bools: bool
             ) -> tuple[str, str, str, list[tuple[str, str]], bytes | ParsedBody]:
    """The HTTP-shaped request of a call. A JSON body is handed over parsed, as `ParsedBody`:
    the line was parsed once, here, and is not encoded and parsed again."""
    http_method, template, path_param, has_body = route

    def parsed(pick: Callable[[dict[str, Any]], Any]) -> ParsedBody:
        def exact() -> Any:
            return pick(exact_call()["params"])
        return ParsedBody(pick(params), may_contain_bools, size, exact)

    rest = dict(params)
    path = template
    if path_param is not None:
        value = rest.pop(path_param, None)
        if path_param == "worker_id":
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise _ParamsError("worker_id must be an integer")
            segment = str(value)
        else:
            if not isinstance(value, str):
                raise _ParamsError(f"{path_param} must be a string")
            segment = value
        path = template.format(quote(segment, safe=""))
    headers = [_JSON]
    if method == "kv_events":
        query = _query({k: rest.pop(k) for k in EVENT_QUERY if k in rest})
        if "batch_b64" in rest:
            encoded = rest.pop("batch_b64")
            try:
                body = base64.b64decode(encoded, validate=True) if isinstance(encoded, str) else None
            except (binascii.Error, ValueError):
                body = None
            if body is None:
                raise _ParamsError("batch_b64 must be base64")
            return http_method, path, query, [_MSGPACK], body
        return http_method, path, query, headers, parsed(lambda p: p.get("events", []))
    if has_body:
        return http_method, path, "", headers, parsed(lambda p: _without(p, path_param))
    if "cached_tokens" in rest and method in _OBSERVING:  # the engine's count, as the HTTP body
        del rest["cached_tokens"]
        return http_method, path, _query(rest), headers, parsed(lambda p: {"cached_tokens": p["cached_tokens"]})
    return http_method, path, _query(rest), headers, b""


# The body-less routes that take the engine's `cached_tokens` (docs/VERDICT.md).
_OBSERVING: Final = ("reservations.prefill_complete", "reservations.free")


def _without(params: dict[str, Any], name: str | None) -> dict[str, Any]:
    rest = dict(params)
    if name is not None:
        rest.pop(name, None)
    return rest


def _query(params: dict[str, Any]) -> str:
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise _ParamsError(f"{name} must be a string or an integer")
    return urlencode({k: str(v) for k, v in params.items()})
