"""OpenAI request parsing and answer building for the real worker adapters.

The prompt of a chat request is rendered with one fixed template (`render_chat`), the same in
prefill and decode workers, so both tokenize a request to the same ids.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any

from mesh.errors import InvalidRequest
from mesh.sse import Answer  # noqa: F401 - re-exported for the adapters
from workers.engine.sampling import SamplingParams
from workers.engine.tokenizer import Tokenizer


def render_chat(messages: list[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(x.get("text", "") for x in c if isinstance(x, dict))
        parts.append(f"<|{m.get('role')}|>\n{c or ''}\n")
    return "".join(parts) + "<|assistant|>\n"


@dataclass(frozen=True, slots=True)
class GenRequest:
    kind: str
    model: str
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool = False   # extension (as vLLM): each choice also carries its token ids


def parse(kind: str, body: Any, tok: Tokenizer, vocab: int, max_model_len: int) -> GenRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    if kind == "completions":
        p = body.get("prompt")
        if isinstance(p, str) and p:
            ids = tok.encode(p)
        elif isinstance(p, list) and p and all(type(t) is int for t in p):
            ids = list(p)
        elif isinstance(p, list) and len(p) == 1 and isinstance(p[0], str) and p[0]:
            ids = tok.encode(p[0])
        else:
            raise InvalidRequest("prompt must be a non-empty string or token id array (one prompt per request)",
                                 param="prompt")
    else:
        ms = body.get("messages")
        if not isinstance(ms, list) or not ms or not all(isinstance(m, dict) for m in ms):
            raise InvalidRequest("messages must be a non-empty array of objects", param="messages")
        ids = tok.encode(render_chat(ms))
    if not ids:
        raise InvalidRequest("the prompt tokenizes to nothing", param="prompt")
    if any(not 0 <= t < vocab for t in ids):
        raise InvalidRequest(f"token ids must be in [0, {vocab})", param="prompt")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    mt = 16 if mt is None else mt
    if type(mt) is not int or mt < 1:
        raise InvalidRequest("max_tokens must be a positive integer", param="max_tokens")
    if len(ids) + mt > max_model_len:
        raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({mt}) exceeds the model's "
                             f"{max_model_len} positions", param="max_tokens")
    stop_ids = body.get("stop_token_ids") or ()
    temp = body.get("temperature")
    try:
        params = SamplingParams(max_tokens=mt, temperature=1.0 if temp is None else float(temp),
                                top_p=float(body.get("top_p") or 1.0), top_k=int(body.get("top_k") or 0),
                                seed=body.get("seed"), stop_token_ids=tuple(int(t) for t in stop_ids),
                                ignore_eos=bool(body.get("ignore_eos", False)))
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"bad sampling parameter: {e}") from None
    so = body.get("stream_options") or {}
    return GenRequest(kind, str(body.get("model", "")), ids, params, bool(body.get("stream")),
                      bool(isinstance(so, dict) and so.get("include_usage")), bool(body.get("return_token_ids")))


class Detokenizer:
    """Text for tokens as they come (byte tokens may split a UTF-8 character)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self._bytes = codecs.getincrementaldecoder("utf-8")("replace") if hasattr(tok, "bos_id") else None
        self._ids: list[int] = []
        self._sent = ""

    def add(self, ids: list[int], final: bool = False) -> str:
        if self._bytes is not None:
            return self._bytes.decode(bytes(i for i in ids if 0 <= i < 256), final=final)
        self._ids += ids
        text = self.tok.decode(self._ids)
        new, self._sent = text[len(self._sent):], text
        return new
