"""`GET /openapi.json`, generated from the route table and the request types' member kinds (api.md §6)."""

from __future__ import annotations

from typing import Any

import attrs

from .._version import __version__
from .codec import FACTORY_TYPE
from .routes import ROUTES

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
    for route in ROUTES:
        params = [{"name": name[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in route.template.split("/") if name.startswith("{")]
        params += [{"name": q, "in": "query", "required": False, "schema": {"type": "string"}}
                   for q in route.query]
        op: dict[str, Any] = {"operationId": route.operation, "parameters": params, "responses": {}}
        if route.body_type is not None:
            _component(route.body_type, schemas)
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{route.body_type.__name__}"}}}}
        elif route.body:  # POST /kv_events: JSON events or an engine msgpack batch
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {}}, "application/msgpack": {"schema": {}}}}
        for status in route.statuses:
            response: dict[str, Any] = {"description": str(status)}
            if status >= 400:
                response["content"] = {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
            op["responses"][str(status)] = response
        paths.setdefault(route.template, {})[route.method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": "selection-proto", "version": __version__},
            "paths": paths, "components": {"schemas": schemas}}
