"""/openapi.json with the real request bodies.

The generation routes read their body themselves (`parse_request`: strict JSON, OpenAI
400s), so FastAPI cannot infer it; each route declares its pydantic model as the body
schema (`body_schema`) and `install_openapi` puts the models' JSON schemas into
`components.schemas`, so standard tools (schemathesis, openapi-generator) see the same
fields and types the server validates.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make `app.openapi()` include the JSON schemas of `models` (and what they use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in models],
                                         ref_template=_REF)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
