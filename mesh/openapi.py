"""The mesh's OpenAPI 3.0 document, served at `/openapi.json`: every route (tests check it against the
app's router and validate it with openapi-spec-validator; schemathesis fuzzes it in CI)."""

from __future__ import annotations

from typing import Any

from mesh import __version__

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}}}

_COMMON = {
    "model": {"type": "string", "minLength": 1},
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 128},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "seed": {"type": "integer"},
    "user": {"type": "string"},
}

# the parameters every engine behind the mesh serves (this project's engine included); others
# (tools, response_format, penalties...) go to the engine as they came, and an engine that does
# not serve one answers a 400 naming it
_COMPLETION = {"type": "object", "required": ["model", "prompt"], "properties": {
    **_COMMON,
    "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "echo": {"type": "boolean"},
    "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "minItems": 1, "items": {"type": "string"}},
                         {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]}}}

_CHAT = {"type": "object", "required": ["model", "messages"], "properties": {
    **_COMMON,
    "logprobs": {"type": "boolean"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role"],
        "properties": {"role": {"type": "string", "minLength": 1},
                       "content": {"nullable": True, "oneOf": [{"type": "string"}, {"type": "array", "items": {
                           "type": "object", "required": ["type"], "properties": {"type": {"type": "string"},
                                                                                 "text": {"type": "string"}}}}]}}}}}}


def _generation(schema: dict[str, Any], summary: str) -> dict[str, Any]:
    err = {"description": "an OpenAI error", "content": {"application/json": {"schema": _ERROR}}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {
            "200": {"description": "the answer (JSON), or an SSE stream when `stream` is true",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **{code: err for code in ("400", "401", "404", "413", "429", "502", "503", "504")}}}}


def document() -> dict[str, Any]:
    ok = {"200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}}
    err = {"description": "an OpenAI error", "content": {"application/json": {"schema": _ERROR}}}
    admin = {"security": [{"adminToken": []}, {}],  # the admin token, where `--admin-token` is set
             "responses": {**ok, "401": err}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "Atomesh", "version": __version__,
                 "description": "OpenAI-compatible prefill/decode disaggregation gateway"},
        "paths": {
            "/v1/completions": _generation(_COMPLETION, "Text completion (PD when the mesh runs in PD mode)"),
            "/v1/chat/completions": _generation(_CHAT, "Chat completion"),
            "/v1/models": {"get": {"summary": "Models served by the registered workers", "responses": ok}},
            "/health": {"get": {"summary": "Liveness", "responses": ok}},
            "/ready": {"get": {"summary": "Readiness (503 when no model can be served)", "responses": {
                **ok, "503": {"description": "not ready", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
                "description": "the text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/workers": {"get": {"summary": "The fleet: every worker, its health, load and record", **admin}},
            "/kv/ledger": {"get": {"summary": "Open KV transfers and terminal counts", **admin}},
            "/openapi.json": {"get": {"summary": "This document", "responses": ok}},
            "/dashboard": {"get": {"summary": "A live view of the fleet (HTML)", "responses": {"200": {
                "description": "the page", "content": {"text/html": {"schema": {"type": "string"}}}}}}},
        },
        "components": {"securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}}},
    }
