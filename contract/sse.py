"""OpenAI completion / chat answers, whole or as SSE chunks: one builder for the workers and the mesh.

The mesh uses it to send a PD stream's first token early (it must be the very bytes the decode
worker would have sent); the reference workers and the mock fleet use it for everything.
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson


class Answer:
    """OpenAI completion / chat answers, whole or as SSE chunks."""

    def __init__(self, kind: str, model: str, request_id: str, meta: Any = None) -> None:
        """`meta` (`kv_transfer_params.response_meta` from the mesh) fixes id and created, so a
        stream is the same bytes whether the mesh sent its first token early or not."""
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + (request_id or os.urandom(8).hex())
        self.created = int(time.time())
        if isinstance(meta, dict):
            if isinstance(meta.get("id"), str):
                self.id = meta["id"]
            if type(meta.get("created")) is int:
                self.created = meta["created"]

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, usage: dict[str, int], extra: dict[str, Any] | None = None,
              token_ids: list[int] | None = None) -> bytes:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                  if self.kind == "chat" else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return orjson.dumps({**self._head(False), "choices": [choice], "usage": usage, **(extra or {})})

    def whole_choices(self, choices: list[dict[str, Any]], usage: dict[str, int],
                      extra: dict[str, Any] | None = None) -> bytes:
        """Several choices: each `{index, text, finish, logprobs, token_ids}` (None: left out)."""
        out = []
        for c in choices:
            if self.kind == "chat":
                ch: dict[str, Any] = {"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                                      "logprobs": c.get("logprobs"), "finish_reason": c["finish"]}
            else:
                ch = {"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"),
                      "finish_reason": c["finish"]}
            if c.get("token_ids") is not None:
                ch["token_ids"] = c["token_ids"]
            out.append(ch)
        return orjson.dumps({**self._head(False), "choices": out, "usage": usage, **(extra or {})})

    def first_chunk(self, n: int = 1) -> bytes:
        if self.kind != "chat":
            return b""
        return b"".join(self._sse({**self._head(True), "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) for i in range(n))

    def chunk(self, text: str, finish: str | None, token_ids: list[int] | None = None, *, index: int = 0,
              logprobs: Any = None) -> bytes:
        choice: dict[str, Any]
        if self.kind == "chat":
            choice = {"index": index, "delta": {"content": text}, "finish_reason": finish}
            if logprobs is not None:
                choice["logprobs"] = logprobs
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return self._sse({**self._head(True), "choices": [choice]})

    def usage_chunk(self, usage: dict[str, int]) -> bytes:
        return self._sse({**self._head(True), "choices": [], "usage": usage})

    @staticmethod
    def _sse(d: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(d) + b"\n\n"

    DONE = b"data: [DONE]\n\n"
