"""One exception tree for the mesh; each class knows its HTTP status and OpenAI error type.

The error middleware in `mesh.app` is the only place that turns these into responses
(`MeshError.body()`); everything else raises.
"""

from __future__ import annotations

from typing import Any

import orjson


class MeshError(Exception):
    """Base of every error the mesh raises on purpose."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None
    # a failed leg: may the worker still hold KV for it? (a cut-off prefill may; one that answered,
    # or never connected, does not). Declared per class, overridden per error by the leg that knows.
    may_hold_kv: bool = False

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, headers: dict[str, str] | None = None,
                 may_hold_kv: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if may_hold_kv is not None:
            self.may_hold_kv = may_hold_kv
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


# -- client side (4xx) -------------------------------------------------------------------

class InvalidRequest(MeshError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(MeshError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(MeshError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class ModelNotFound(MeshError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLarge(MeshError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class RequestTimeout(MeshError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class Overloaded(MeshError):
    status = 429
    type = "rate_limit_error"
    code = "overloaded"


# -- upstream side (5xx) -----------------------------------------------------------------

class UpstreamError(MeshError):
    """A worker failed: connection refused, 5xx, garbage in its answer."""

    status = 502
    type = "upstream_error"
    code = "upstream_error"
    may_hold_kv = True


class KVSourceLost(UpstreamError):
    """The decode engine answered that it could not pull the KV from the prefill pipeline: the
    pipeline (`pipeline`, set by the proxy) is at fault, not the decode engine."""

    code = "kv_transfer_failed"
    pipeline: Any = None


class UpstreamClientError(MeshError):
    """A worker refused the request with a 4xx: passed on to the client as it came."""

    type = "invalid_request_error"

    def __init__(self, status: int, raw_body: bytes, message: str) -> None:
        super().__init__(message, status=status, code="upstream_rejected", may_hold_kv=False)
        self.raw_body = raw_body

    def body(self) -> bytes:
        return self.raw_body


class UpstreamTimeout(MeshError):
    status = 504
    type = "upstream_timeout"
    code = "upstream_timeout"
    may_hold_kv = True


class NoWorker(MeshError):
    """No healthy worker of the needed role serves the model."""

    status = 503
    type = "service_unavailable"
    code = "no_healthy_worker"


class InsufficientKV(MeshError):
    """No pipeline has free KV blocks for this prompt right now."""

    status = 503
    type = "service_unavailable"
    code = "kv_exhausted"


class ProtocolError(MeshError):
    """A message on a worker boundary does not match docs/protocol.md."""

    status = 502
    type = "upstream_error"
    code = "protocol_error"


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


class KVTransferError(MeshError):
    """The KV hand-off failed: a stage answered ok=false, or the deadline passed."""

    status = 502
    type = "upstream_error"
    code = "kv_transfer_failed"
