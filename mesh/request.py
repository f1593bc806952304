"""Client request validation: raw JSON body -> typed `ClientRequest`, in one place.

Every error is an `InvalidRequest` naming the offending field (`param`), so the client gets
an OpenAI error body with status 400. Fields the mesh does not know pass through untouched.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from contract.errors import InvalidRequest, PayloadTooLarge

Kind = Literal["completions", "chat"]
# request ids: a random per-process prefix and a counter (unique across replicas, no syscall)
_ID_PREFIX = os.urandom(6).hex()
_ids = itertools.count(1)
PATHS: dict[Kind, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int = 8 * 1024 * 1024
    max_tokens: int = 131072          # largest max_tokens a client may ask for
    max_prompt_chars: int = 4 * 1024 * 1024
    body_timeout_s: float = 30.0      # a request body must arrive within this (slow uploads: 408)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tokens", "max_prompt_chars", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(slots=True, eq=False)
class ClientRequest:
    """A validated client request. `body` is the client's JSON object, as sent."""
    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    body: dict[str, Any]
    request_id: str
    session_key: str | None
    _prompt: str | None = field(default=None, init=False, repr=False)   # rendered once, when a policy asks
    # the body's bytes as the client sent them (regular mode forwards them; a view where the fast
    # server read them with the head, `mesh.h1server`)
    raw: bytes | memoryview = field(default=b"", repr=False)

    @property
    def path(self) -> str:
        return PATHS[self.kind]

    def prompt_text(self) -> str:
        """The whole rendered prompt: chat renders every message, not only the first."""
        if self._prompt is None:
            self._prompt = render_prompt(self.kind, self.body)
        return self._prompt

    def prompt_tokens_estimate(self) -> int:
        """Byte-level estimate (the reference engine's default tokenizer is byte-level)."""
        p = self.body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], int):
            return len(p)
        return len(self.prompt_text().encode())


def render_prompt(kind: Kind, body: dict[str, Any]) -> str:
    if kind == "completions":
        p = body["prompt"]
        if isinstance(p, str):
            return p
        if p and isinstance(p[0], int):
            return " ".join(map(str, p))
        return "\x1e".join(x if isinstance(x, str) else " ".join(map(str, x)) for x in p)
    parts = []
    for m in body["messages"]:
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(x.get("text", "") for x in c if isinstance(x, dict))
        parts.append(f"{m.get('role')}\x1f{c or ''}")
    return "\x1e".join(parts)


def _bad(param: str, msg: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {msg}" if param else msg, param=param or None)


def _type(v: Any) -> str:
    return "null" if v is None else {dict: "object", list: "array", str: "string", bool: "boolean",
                                     int: "integer", float: "number"}.get(type(v), type(v).__name__)


def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if type(v) is not int:
        raise _bad(name, f"must be an integer, got {_type(v)}")
    if not lo <= v <= hi:
        raise _bad(name, f"must be between {lo} and {hi}, got {v}")
    return v


def _num(body: dict[str, Any], name: str, lo: float, hi: float) -> None:
    v = body.get(name)
    if v is None:
        return
    if type(v) not in (int, float):
        raise _bad(name, f"must be a number, got {_type(v)}")
    if not lo <= v <= hi:
        raise _bad(name, f"must be between {lo} and {hi}, got {v}")


def _check_prompt(p: Any) -> None:
    if isinstance(p, str):
        if not p:
            raise _bad("prompt", "must not be empty")
        return
    if not isinstance(p, list) or not p:
        raise _bad("prompt", f"must be a non-empty string or array, got {_type(p)}")
    first = p[0]
    if isinstance(first, str):
        for i, x in enumerate(p):
            if not isinstance(x, str):
                raise _bad(f"prompt[{i}]", f"must be a string, got {_type(x)}")
    elif type(first) is int:
        for i, x in enumerate(p):
            if type(x) is not int or x < 0:
                raise _bad(f"prompt[{i}]", "must be a non-negative integer token id")
    elif isinstance(first, list):
        for i, x in enumerate(p):
            if not isinstance(x, list) or not x or not all(type(t) is int and t >= 0 for t in x):
                raise _bad(f"prompt[{i}]", "must be a non-empty array of token ids")
    else:
        raise _bad("prompt[0]", f"must be a string, token id or array of token ids, got {_type(first)}")


def _check_messages(ms: Any) -> None:
    if not isinstance(ms, list) or not ms:
        raise _bad("messages", f"must be a non-empty array, got {_type(ms)}")
    for i, m in enumerate(ms):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"must be an object, got {_type(m)}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role", "is required and must be a string")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise _bad(f"messages[{i}].content", f"must be a string or array, got {_type(c)}")
        if isinstance(c, list):
            for j, part in enumerate(c):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _bad(f"messages[{i}].content[{j}]", "must be an object with a string 'type'")




def parse(kind: Kind, raw: bytes | memoryview, limits: Limits, *, request_id: str | None = None,
          session_key: str | None = None) -> ClientRequest:
    """Validate a client body. Raises InvalidRequest / PayloadTooLarge naming the field."""
    if len(raw) > limits.max_body_bytes:
        raise PayloadTooLarge(f"body is {len(raw)} bytes; the limit is {limits.max_body_bytes}")
    if not raw:
        raise _bad("", "request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise _bad("", f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise _bad("", f"request body must be a JSON object, got {_type(body)}")
    try:   # what the legs do with it (orjson stops at 255 levels): at memory speed, cheaper than
        # counting brackets in the raw bytes. Only arrays and objects nest: each is encoded here one
        # level down, as in the body (`[v]`: the same limit, tests/test_admission.py), and a long
        # string prompt is not encoded for it (220 kB: ~7 us and a 220 kB copy a request)
        for v in body.values():
            if type(v) is list or type(v) is dict:
                orjson.dumps([v])
    except orjson.JSONEncodeError:
        raise _bad("", "request body is nested too deeply to forward") from None

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "is required and must be a non-empty string" if model is None
                   else f"must be a non-empty string, got {_type(model)}")
    if kind == "completions":
        if "prompt" not in body:
            raise _bad("prompt", "is required")
        _check_prompt(body["prompt"])
    else:
        if "messages" not in body:
            raise _bad("messages", "is required")
        _check_messages(body["messages"])

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if type(stream) is not bool:
        raise _bad("stream", f"must be a boolean, got {_type(stream)}")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("stream_options", f"must be an object, got {_type(so)}")
        if not stream:
            raise _bad("stream_options", "is only allowed when stream is true")
        iu = so.get("include_usage", False)
        if type(iu) is not bool:
            raise _bad("stream_options.include_usage", f"must be a boolean, got {_type(iu)}")
        include_usage = iu

    max_tokens = _int(body, "max_tokens", 1, limits.max_tokens)
    mct = _int(body, "max_completion_tokens", 1, limits.max_tokens)
    if mct is not None:
        max_tokens = mct if max_tokens is None else min(max_tokens, mct)
    _int(body, "n", 1, 128)  # regular mode passes it on; PD flows split it or refuse it (mesh.flows)
    _num(body, "temperature", 0.0, 2.0)
    _num(body, "top_p", 0.0, 1.0)
    _num(body, "presence_penalty", -2.0, 2.0)
    _num(body, "frequency_penalty", -2.0, 2.0)
    _int(body, "seed", -(2 ** 63), 2 ** 64 - 1)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop", "must be a string or an array of strings")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", f"must be a string, got {_type(user)}")
    if "kv_transfer_params" in body:
        raise _bad("kv_transfer_params", "is set by the mesh, not by clients")

    req = ClientRequest(kind, model, stream, include_usage, max_tokens, body,
                        request_id or f"{_ID_PREFIX}{next(_ids):08x}", session_key or user, raw=raw)
    if len(req.prompt_text()) > limits.max_prompt_chars:
        raise _bad("prompt" if kind == "completions" else "messages",
                   f"is longer than the limit of {limits.max_prompt_chars} characters")
    return req


def check_request_id(value: str | None) -> str | None:
    """A client-supplied X-Request-Id is kept when it is short and printable."""
    if value and len(value) <= 128 and value.isascii() and value.isprintable():
        return value
    return None
