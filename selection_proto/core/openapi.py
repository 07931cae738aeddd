"""`GET /openapi.json`, generated from the route table and the request types' member kinds (api.md §6)."""

from __future__ import annotations

from typing import Any, Final

import attrs

from .._version import __version__
from .base.codec import FACTORY_TYPE
from .base.routes import ROUTES

__all__ = ["document"]

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
    if tag == "nullable":
        return {"anyOf": [_schema(kind[1], schemas), {"type": "null"}]}
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
            if "enum" in prop:  # null must be one of the values too
                prop["enum"] = [*prop["enum"], None]
        elif meta.get("nullable"):
            prop = {"anyOf": [prop, {"type": "null"}]}
        if meta.get("required"):
            required.append(field.name)
        elif field.default is not attrs.NOTHING and not isinstance(field.default, FACTORY_TYPE) \
                and not attrs.has(type(field.default)):  # an object's default is its members' defaults
            prop["default"] = field.default
        props[field.name] = prop
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    schemas[cls.__name__] = schema


_INT: Final = {"type": "integer"}
_STR: Final = {"type": "string"}
_LOAD: Final = {"type": "object", "properties": {n: _INT for n in (
    "worker_id", "dp_rank", "potential_prefill_tokens", "potential_decode_blocks", "active_requests")}}
# The answers' shapes (their members; 1.6.1's beside ours, docs/DECISIONS.md), by operation.
_ANSWERS: Final[dict[str, dict[str, Any]]] = {
    "StatusOk": {"type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]},
    "WorkerRecord": {"type": "object", "description": "A WorkerRequest's members, with lifecycle and reasons.",
                     "properties": {"worker_id": _INT, "routing_group": _STR, "is_eagle": {"type": ["boolean", "null"]},
                                    "lifecycle": {"enum": ["incomplete", "schedulable",
                                                                              "draining", "unschedulable"]},
                                    "not_schedulable_reasons": {"type": "array", "items": _STR},
                                    "kv_routing": {"type": "object", "description": "GET /workers only: "
                                                   "is KV routing working (docs/VERDICT.md)", "properties": {
                                        "state": {"enum": ["ok", "waiting", "no_events", "block_size_mismatch",
                                                           "stale", "misses"]},
                                        "reasons": {"type": "array", "items": _STR}}}},
                     "required": ["worker_id", "lifecycle"]},
    "ReadyResponse": {"type": "object", "properties": {
        "ready": {"type": "boolean"}, "schedulable_workers": _INT, "recovered_from": _STR,
        "details": {"type": "array", "items": _STR},
        "workers": {"type": "array", "items": {"$ref": "#/components/schemas/WorkerRecord"}}}},
    "SelectResponse": {"type": "object", "properties": {
        **{n: _STR for n in ("selection_id", "reservation_id", "model_name", "tenant_id", "routing_group",
                             "endpoint")},
        **{n: _INT for n in ("worker_id", "dp_rank", "cached_tokens", "block_size", "effective_prefill_tokens",
                             "potential_decode_blocks", "isl_tokens")},
        "effective_overlap_blocks": {"type": "number"}, "track_prefill_tokens": {"type": "boolean"},
        "sequence_hashes": {"type": "array", "items": _INT},
        "overlap": {"type": "object", "properties": {
            "longest_matched": _INT, "gpu": _INT, "cpu": _INT, "disk": _INT,
            "dp": {"type": "object", "additionalProperties": _INT}}},
        "worker_load": {"type": "object", "additionalProperties": _INT},
        "candidates": {"type": "array", "items": {"type": "object"}},
        "excluded": {"type": "array", "items": {"type": "object"}}},
        "required": ["model_name", "worker_id", "dp_rank", "endpoint"]},
    "ReservationResponse": {"type": "object", "properties": {
        **{n: _STR for n in ("reservation_id", "selection_id", "model_name", "tenant_id", "routing_group",
                             "endpoint")}, "worker_id": _INT, "dp_rank": _INT}},
    "Loads": {"type": "array", "items": {"type": "object", "properties": {
        "model_name": _STR, "tenant_id": _STR, "routing_group": _STR, "loads": {"type": "array", "items": _LOAD},
        "pending_count": _INT, "pending_isl_tokens": _INT}}},
    "PotentialLoads": {"type": "array", "items": _LOAD},
    "OverlapScoresResponse": {"type": "object", "properties": {
        "block_size": _INT, "num_blocks": _INT, "workers": {"type": "array", "items": {"type": "object"}},
        "freshness": {"type": "array", "items": {"type": "object"}}}},
    "ApplyReport": {"type": "object", "properties": {
        **{n: _INT for n in ("received", "applied", "failed", "dropped")},
        "failures": {"type": "array", "items": {"type": "object", "properties": {"index": _INT, "error": _STR}}}}},
    "Dump": {"type": "object", "description": "api.md §7: format, version, keys, workers, events."},
    "PlanResponse": {"type": "object", "description": "A prefill/decode plan (docs/PD.md).", "properties": {
        **{n: _STR for n in ("plan_id", "selection_id", "model_name", "tenant_id")},
        "path": {"enum": ["local", "remote"]}, "block_size": _INT,
        "decode": {"type": "object", "properties": {
            **{n: _INT for n in ("worker_id", "dp_rank", "cached_tokens")}, "endpoint": _STR,
            "reservation_id": {"type": ["string", "null"]}, "effective_overlap_blocks": {"type": "number"}}},
        "prefill": {"type": ["object", "null"], "properties": {
            **{n: _INT for n in ("worker_id", "dp_rank", "cached_tokens")}, "endpoint": _STR,
            "reservation_id": {"type": ["string", "null"]}, "bootstrap_host": {"type": ["string", "null"]},
            "bootstrap_port": {"type": ["integer", "null"]}}},
        "decision": {"type": "object", "properties": {
            "decider": _STR, "isl": _INT, "cached_on_decode": _INT, "uncached_on_decode": _INT,
            "ratio": {"type": "number"}, "flags": {"type": "array", "items": _STR}, "reason": _STR}},
        "candidates": {"type": "array", "items": {"type": "object"}},
        "prefill_candidates": {"type": "array", "items": {"type": "object"}},
        "excluded": {"type": "array", "items": {"type": "object"}}},
        "required": ["plan_id", "model_name", "tenant_id", "path", "decode", "prefill", "decision"]},
    "PlanReleased": {"type": "object", "properties": {
        "status": {"const": "ok"}, "plan_id": _STR,
        "released": {"type": "array", "items": {"enum": ["prefill", "decode", "decode_prefill"]}}},
        "required": ["status", "plan_id", "released"]},
    "OpenApi": {"type": "object"},
    "Status": {"type": "object", "description": "docs/STATUS.md: version, ready, serving, policy, shadow_policy, "
                                                "kv_events, summary, keys, workers (worst first, at most 100 of "
                                                "workers_matched), filter, detail, decisions.",
               "required": ["version", "ready", "serving", "summary", "keys", "workers", "workers_matched", "filter",
                            "detail", "decisions"]},
}
_ANSWER_OF: Final[dict[str, tuple[str, str]]] = {  # operation -> (schema, media type)
    "health": ("StatusOk", "application/json"), "ready": ("ReadyResponse", "application/json"),
    "readyz": ("StatusOk", "application/json"),
    "upsert_worker": ("WorkerRecord", "application/json"), "patch_worker": ("WorkerRecord", "application/json"),
    "delete_worker": ("WorkerRecord", "application/json"), "get_worker": ("WorkerRecord", "application/json"),
    "select": ("SelectResponse", "application/json"), "select_and_reserve": ("SelectResponse", "application/json"),
    "reserve": ("ReservationResponse", "application/json"),
    "select_pd": ("PlanResponse", "application/json"), "select_pd_and_reserve": ("PlanResponse", "application/json"),
    "plan_handoff": ("PlanReleased", "application/json"), "end_plan": ("PlanReleased", "application/json"),
    "prefill_complete": ("StatusOk", "application/json"), "output_block": ("StatusOk", "application/json"),
    "free": ("StatusOk", "application/json"), "loads": ("Loads", "application/json"),
    "potential_loads": ("PotentialLoads", "application/json"),
    "overlap_scores": ("OverlapScoresResponse", "application/json"),
    "kv_events": ("ApplyReport", "application/json"), "dump": ("Dump", "application/json"),
    "openapi": ("OpenApi", "application/json"), "status": ("Status", "application/json"),
}
_TEXT_ANSWERS: Final = {"metrics": "text/plain", "status_page": "text/html", "status_events": "text/event-stream"}
_MSGPACK_BODY: Final = ("The JSON body's members as one msgpack map (string keys; no extension "
                        "types). A u32 array such as token_ids may be a bin of little-endian u32.")
# POST /kv_events: Dynamo JSON events (one, or an array), or one engine msgpack batch.
_EVENTS: Final = {"oneOf": [{"type": "object", "description": "a RouterEvent or a bare KvCacheEvent"},
                            {"type": "array", "items": {"type": "object"}}]}


def document() -> dict[str, Any]:
    schemas: dict[str, Any] = {
        "ErrorResponse": {"type": "object", "properties": {"error": {"type": "string"}},
                          "required": ["error"]}, **_ANSWERS}
    paths: dict[str, Any] = {}
    for route in ROUTES:
        params = [{"name": name[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in route.template.split("/") if name.startswith("{")]
        params += [{"name": q, "in": "query", "required": False, "schema": {"type": "string"}}
                   for q in route.query]
        op: dict[str, Any] = {"operationId": route.operation, "summary": route.summary, "parameters": params,
                              "responses": {}}
        if route.body_type is not None:
            _component(route.body_type, schemas)
            ref = {"$ref": f"#/components/schemas/{route.body_type.__name__}"}
            # The same members in msgpack; a u32 array (`token_ids`) may also be a `bin` of
            # little-endian u32 (docs/DECISIONS.md, "msgpack bodies").
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": ref},
                "application/msgpack": {"schema": {**ref, "description": _MSGPACK_BODY}}}}
        elif route.body:  # POST /kv_events: JSON events or an engine msgpack batch
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": _EVENTS},
                "application/msgpack": {"schema": {"type": "string", "format": "binary",
                                                   "description": "one engine KVEventBatch"}}}}
        for status in route.statuses:
            response: dict[str, Any] = {"description": str(status)}
            if status >= 400:
                response["content"] = {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
            elif 200 <= status < 300 and route.operation in _TEXT_ANSWERS:
                response["content"] = {_TEXT_ANSWERS[route.operation]: {"schema": {"type": "string"}}}
            elif 200 <= status < 300 and route.operation == "list_workers":
                response["content"] = {"application/json": {"schema": {
                    "type": "array", "items": {"$ref": "#/components/schemas/WorkerRecord"}}}}
            elif 200 <= status < 300 and route.operation in _ANSWER_OF:
                name, media = _ANSWER_OF[route.operation]
                response["content"] = {media: {"schema": {"$ref": f"#/components/schemas/{name}"}}}
            op["responses"][str(status)] = response
        paths.setdefault(route.template, {})[route.method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": "selection-proto", "version": __version__},
            "paths": paths, "components": {"schemas": schemas}}
