"""OpenAI request parsing and answer building for the real worker adapters.

The prompt of a chat request is rendered with one fixed template (`render_chat`), the same in
prefill and decode workers, so both tokenize a request to the same ids.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any

from contract.errors import InvalidRequest
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
    n: int = 1                       # choices; choice j samples with seed + j when a seed is given
    stop: tuple[str, ...] = ()       # stop strings: the text ends before the first one (not included)
    echo: bool = False               # completions: the prompt's text leads the first chunk / the text
    prompt_text: str = ""


# OpenAI and vLLM parameters this engine does not serve: a clear 400 naming them, never a 200 that
# ignored them. A parameter at its neutral value (tools: [], penalties 0, best_of 1...) is served.
_UNSUPPORTED: dict[str, Any] = {
    "tools": lambda v: bool(v), "tool_choice": lambda v: v not in (None, "none", "auto"),
    "functions": lambda v: bool(v), "function_call": lambda v: v not in (None, "none", "auto"),
    "response_format": lambda v: v is not None and not (isinstance(v, dict) and v.get("type") == "text"),
    "logit_bias": lambda v: bool(v), "suffix": lambda v: bool(v), "best_of": lambda v: v not in (None, 1),
    "presence_penalty": lambda v: v not in (None, 0, 0.0), "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "repetition_penalty": lambda v: v not in (None, 1, 1.0), "prompt_logprobs": lambda v: v is not None,
    "guided_json": lambda v: v is not None, "guided_regex": lambda v: v is not None,
    "guided_choice": lambda v: v is not None, "guided_grammar": lambda v: v is not None,
    "structured_outputs": lambda v: v is not None, "min_p": lambda v: v not in (None, 0, 0.0),
    "audio": lambda v: v is not None, "modalities": lambda v: v not in (None, ["text"]),
    "prediction": lambda v: v is not None,
}


_UNSUPPORTED_NAMES = frozenset(_UNSUPPORTED)


def _check_supported(body: dict[str, Any]) -> None:
    for name in _UNSUPPORTED_NAMES.intersection(body):
        if _UNSUPPORTED[name](body[name]):
            raise InvalidRequest(f"{name} is not supported by this engine", param=name)


def _logprobs(kind: str, body: dict[str, Any]) -> int | None:
    """Completions: `logprobs` k (top k alternatives, 0..20). Chat: `logprobs` true, with
    `top_logprobs` k (0..20, only with logprobs true)."""
    lp = body.get("logprobs")
    if kind == "completions":
        if lp is None:
            return None
        if type(lp) is not int or not 0 <= lp <= 20:
            raise InvalidRequest("logprobs must be an integer in 0..20 on /v1/completions", param="logprobs")
        return lp
    top = body.get("top_logprobs")
    if lp is not None and type(lp) is not bool:
        raise InvalidRequest("logprobs must be a boolean on /v1/chat/completions", param="logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= 20):
        raise InvalidRequest("top_logprobs must be an integer in 0..20", param="top_logprobs")
    if top and not lp:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if lp else None


def parse(kind: str, body: Any, tok: Tokenizer, vocab: int, max_model_len: int) -> GenRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    _check_supported(body)
    text = ""
    given = False   # token ids from the client (not from the tokenizer): range-checked below
    if kind == "completions":
        p = body.get("prompt")
        if isinstance(p, str) and p:
            ids, text = tok.encode(p), p
        elif isinstance(p, list) and p and all(type(t) is int for t in p):
            ids, given = list(p), True
        elif isinstance(p, list) and len(p) == 1 and isinstance(p[0], str) and p[0]:
            ids, text = tok.encode(p[0]), p[0]
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
    if (given or not 0 < getattr(tok, "encode_below", 0) <= vocab) and (min(ids) < 0 or max(ids) >= vocab):
        raise InvalidRequest(f"token ids must be in [0, {vocab})", param="prompt")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    mt = 16 if mt is None else mt
    if type(mt) is not int or mt < 1:
        raise InvalidRequest("max_tokens must be a positive integer", param="max_tokens")
    if len(ids) >= max_model_len:   # the prompt alone: name it (a PD prefill leg's max_tokens is the mesh's 1)
        raise InvalidRequest(f"the prompt is {len(ids)} tokens; this model has {max_model_len} positions, room for "
                             f"at most {max_model_len - 1} prompt tokens", param="prompt")
    if len(ids) + mt > max_model_len:
        raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({mt}) exceeds the model's "
                             f"{max_model_len} positions", param="max_tokens")
    stop_ids = body.get("stop_token_ids") or ()
    temp = body.get("temperature")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if type(n) is not int or not 1 <= n <= 128:
        raise InvalidRequest("n must be an integer in 1..128", param="n")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(x, str) and x for x in stops):
        raise InvalidRequest("stop must be a non-empty string or an array of them", param="stop")
    echo = body.get("echo", False)
    if echo not in (True, False, None) or (echo and kind != "completions"):
        raise InvalidRequest("echo is a boolean of /v1/completions", param="echo")
    lp = _logprobs(kind, body)
    if echo and lp is not None:
        raise InvalidRequest("echo with logprobs needs the prompt's logprobs, which this engine does not compute",
                             param="echo")
    mn = body.get("min_tokens") or 0
    if type(mn) is not int or mn < 0:
        raise InvalidRequest("min_tokens must be a non-negative integer", param="min_tokens")
    try:
        params = SamplingParams(max_tokens=mt, temperature=1.0 if temp is None else float(temp),
                                top_p=float(body.get("top_p") or 1.0), top_k=int(body.get("top_k") or 0),
                                seed=body.get("seed"), stop_token_ids=tuple(int(t) for t in stop_ids),
                                ignore_eos=bool(body.get("ignore_eos", False)), logprobs=lp, min_tokens=mn)
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"bad sampling parameter: {e}") from None
    so = body.get("stream_options") or {}
    return GenRequest(kind, str(body.get("model", "")), ids, params, bool(body.get("stream")),
                      bool(isinstance(so, dict) and so.get("include_usage")), bool(body.get("return_token_ids")),
                      n, stops, bool(echo), (text or tok.decode(ids)) if echo else "")


def logprobs_json(kind: str, tok: Tokenizer, ids: list[int], lps: list[Any], offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs object for tokens `ids` with their (logprob, top k) entries: completions'
    legacy `{tokens, token_logprobs, top_logprobs, text_offset}` (the sampled token always among
    the top, as vLLM), chat's `{content: [{token, logprob, bytes, top_logprobs}]}`."""
    def piece(t: int) -> str:
        return tok.decode([t])

    if kind == "chat":
        return {"content": [{"token": piece(t), "logprob": lp, "bytes": list(piece(t).encode()),
                             "top_logprobs": [{"token": piece(i), "logprob": v, "bytes": list(piece(i).encode())}
                                              for i, v in top]}
                            for t, (lp, top) in zip(ids, lps)]}
    texts = [piece(t) for t in ids]
    offs = []
    for x in texts:
        offs.append(offset)
        offset += len(x)
    return {"tokens": texts, "token_logprobs": [lp for lp, _ in lps],
            "top_logprobs": [{**{piece(i): v for i, v in top}, texts[j]: lps[j][0]} for j, (_, top) in enumerate(lps)],
            "text_offset": offs}


class Detokenizer:
    """Text for tokens as they come (byte tokens may split a UTF-8 character)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self._pieces = bool(getattr(tok, "pieces", False))  # each token's text stands alone
        self._bytes = codecs.getincrementaldecoder("utf-8")("replace") if hasattr(tok, "bos_id") else None
        self._ids: list[int] = []
        self._sent = ""

    def add(self, ids: list[int], final: bool = False) -> str:
        if self._pieces:
            return self.tok.decode(ids)
        if self._bytes is not None:
            return self._bytes.decode(bytes(i for i in ids if 0 <= i < 256), final=final)
        self._ids += ids
        text = self.tok.decode(self._ids)
        new, self._sent = text[len(self._sent):], text
        return new
