"""`GET /openapi.json`, generated from the route table and the request types' member kinds (api.md §6)."""

from __future__ import annotations

from typing import Any, Final

import attrs

from .._version import __version__
from .codec import FACTORY_TYPE
from .handler import ROUTES
from .types import (
    OverlapScoresRequest,
    PotentialLoadsRequest,
    ReservationRequest,
    SelectAndReserveRequest,
    SelectRequest,
    WorkerPatchRequest,
    WorkerRequest,
)

__all__ = ["document"]

_OPERATIONS: Final = {
    ("GET", "/health"): ("health", None, (200,)),
    ("GET", "/ready"): ("ready", None, (200, 503)),
    ("POST", "/workers"): ("upsert_worker", WorkerRequest, (201, 400, 409, 413, 415, 422)),
    ("GET", "/workers"): ("list_workers", None, (200, 400)),
    ("PATCH", "/workers/{worker_id}"): ("patch_worker", WorkerPatchRequest,
                                        (200, 400, 404, 409, 413, 415, 422)),
    ("DELETE", "/workers/{worker_id}"): ("delete_worker", None, (200, 400, 404)),
    ("POST", "/select"): ("select", SelectRequest, (200, 400, 413, 415, 422, 429, 503)),
    ("POST", "/select_and_reserve"): ("select_and_reserve", SelectAndReserveRequest,
                                      (200, 400, 409, 413, 415, 422, 429, 500, 503)),
    ("POST", "/reservations"): ("reserve", ReservationRequest, (201, 400, 404, 409, 413, 415, 422, 429, 503)),
    ("POST", "/reservations/{reservation_id}/prefill_complete"): ("prefill_complete", None, (200, 400, 404)),
    ("DELETE", "/reservations/{reservation_id}"): ("free", None, (200, 400, 404)),
    ("GET", "/loads"): ("loads", None, (200, 400)),
    ("POST", "/potential_loads"): ("potential_loads", PotentialLoadsRequest, (200, 400, 413, 415, 422, 503)),
    ("POST", "/overlap_scores"): ("overlap_scores", OverlapScoresRequest, (200, 400, 413, 415, 422, 503)),
    ("POST", "/kv_events"): ("kv_events", None, (200, 400, 404, 409, 413, 415, 422)),
    ("GET", "/kv_events"): ("kv_events_stream", None, (101, 400, 426)),
    ("GET", "/metrics"): ("metrics", None, (200,)),
    ("GET", "/openapi.json"): ("openapi", None, (200,)),
    ("GET", "/dump"): ("dump", None, (200, 400)),
}
_QUERY: Final = {
    "/workers": ("model_name", "tenant_id", "routing_group"),
    "/loads": ("model_name", "tenant_id", "routing_group"),
    "/dump": ("model_name", "tenant_id", "routing_group"),
    "/reservations/{reservation_id}/prefill_complete": ("model_name", "tenant_id", "routing_group"),
    "/reservations/{reservation_id}": ("model_name", "tenant_id", "routing_group"),
    "/kv_events": ("worker_id", "dp_rank", "model_name", "tenant_id", "routing_group", "framing", "ack"),
}


def _schema(kind: tuple[Any, ...], schemas: dict[str, Any]) -> dict[str, Any]:
    tag = kind[0]
    if tag == "int":
        fmt = {"u64": "uint64", "u32": "uint32", "i64": "int64"}[kind[1]]
        return {"type": "integer", "format": fmt, "minimum": kind[2], "maximum": kind[3]}
    if tag == "float":
        return {"type": "number", "format": "float" if kind[1] == "f32" else "double"}
    if tag == "str":
        return {"type": "string"}
    if tag == "bool":
        return {"type": "boolean"}
    if tag == "enum":
        return {"type": "string", "enum": list(kind[1])}
    if tag == "array":
        return {"type": "array", "items": _schema(kind[1], schemas)}
    if tag == "map":
        return {"type": "object", "additionalProperties": _schema(kind[1], schemas)}
    cls = kind[1]
    _component(cls, schemas)
    return {"$ref": f"#/components/schemas/{cls.__name__}"}


def _component(cls: type, schemas: dict[str, Any]) -> None:
    if cls.__name__ in schemas:
        return
    schemas[cls.__name__] = {}
    props: dict[str, Any] = {}
    required: list[str] = []
    for field in attrs.fields(cls):
        meta = field.metadata
        if "kind" not in meta:
            continue
        prop = _schema(meta["kind"], schemas)
        if meta.get("nullable") and "type" in prop:
            prop = {**prop, "type": [prop["type"], "null"]}
        elif meta.get("nullable"):
            prop = {"anyOf": [prop, {"type": "null"}]}
        if meta.get("required"):
            required.append(field.name)
        elif field.default is not attrs.NOTHING and not isinstance(field.default, FACTORY_TYPE):
            prop["default"] = field.default
        props[field.name] = prop
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    schemas[cls.__name__] = schema


def document() -> dict[str, Any]:
    schemas: dict[str, Any] = {
        "ErrorResponse": {"type": "object", "properties": {"error": {"type": "string"}},
                          "required": ["error"]}}
    paths: dict[str, Any] = {}
    for route, methods in ROUTES.items():
        item: dict[str, Any] = {}
        for method in methods:
            op_id, body, statuses = _OPERATIONS[(method, route)]
            params = [{"name": name[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
                      for name in route.split("/") if name.startswith("{")]
            params += [{"name": q, "in": "query", "required": False, "schema": {"type": "string"}}
                       for q in _QUERY.get(route, ()) if method != "POST" or route == "/kv_events"
                       or route.endswith("prefill_complete")]
            op: dict[str, Any] = {"operationId": op_id, "parameters": params, "responses": {}}
            if body is not None:
                _component(body, schemas)
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}
            elif (method, route) == ("POST", "/kv_events"):
                op["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {}}, "application/msgpack": {"schema": {}}}}
            for status in statuses:
                response: dict[str, Any] = {"description": str(status)}
                if status >= 400:
                    response["content"] = {"application/json": {
                        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
                op["responses"][str(status)] = response
            item[method.lower()] = op
        paths[route] = item
    return {"openapi": "3.1.0", "info": {"title": "selection-proto", "version": __version__},
            "paths": paths, "components": {"schemas": schemas}}
