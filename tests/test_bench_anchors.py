"""bench/anchors.py's answer check: what makes the router comparison count only correct answers."""

from __future__ import annotations

import orjson
import pytest

from bench.anchors import check_tokens


def sse(*texts: str, done: bool = True) -> bytes:
    chunks = [b"data: " + orjson.dumps({"choices": [{"index": 0, "text": t}]}) + b"\n\n" for t in texts]
    return b"".join(chunks) + (b"data: [DONE]\n\n" if done else b"")


def test_check_tokens_counts_each_token_once() -> None:
    check_tokens(sse(" t1", " t2", " t3"), True, 3)
    check_tokens(orjson.dumps({"choices": [{"text": " t5 t6"}]}), False, 2)
    with pytest.raises(RuntimeError, match="4 tokens, not 3"):   # token 0 relayed twice
        check_tokens(sse(" t1", " t1", " t2", " t3"), True, 3)
    with pytest.raises(RuntimeError, match="DONE"):
        check_tokens(sse(" t1", done=False), True, 1)
    with pytest.raises(RuntimeError, match="1 tokens, not 2"):
        check_tokens(orjson.dumps({"choices": [{"text": " t5"}]}), False, 2)
