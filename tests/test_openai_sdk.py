"""The official openai SDK (sync and async) as a client of mesh + mock fleet, over real HTTP."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from workers.mock import first_token, token_ids, token_text
from workers.openai_io import render_chat

MODEL = "mock-model"


def expected_text(kind: str, body: dict, n: int) -> str:
    """What a monolithic (non-PD) mock worker answers for this body."""
    prompt = body["prompt"] if kind == "completions" else render_chat(body["messages"])
    return "".join(token_text(t) for t in token_ids(first_token(prompt), n))


def held(urls: list[str]) -> int:
    return sum(len(httpx.get(u + "/kv/held").json()["transfers"]) for u in urls)


def wait_no_held(urls: list[str], timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if held(urls) == 0:
            return 0
        time.sleep(0.05)
    return held(urls)


@pytest.fixture(scope="module")
def client(proc_pd):
    with openai.OpenAI(base_url=proc_pd["url"] + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_completions_sync(client, proc_pd):
    r = client.completions.create(model=MODEL, prompt="The mesh says", max_tokens=7)
    assert r.choices[0].text == expected_text("completions", {"prompt": "The mesh says"}, 7)
    assert r.usage.completion_tokens == 7
    assert wait_no_held(proc_pd["prefill"]) == 0


def test_completions_stream_sync_equals_monolithic(client, proc_pd):
    chunks = list(client.completions.create(model=MODEL, prompt="stream me", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    # the same request straight to a decode worker, without PD, gives the same tokens
    direct = httpx.post(proc_pd["decode"][0] + "/v1/completions",
                        json={"model": MODEL, "prompt": "stream me", "max_tokens": 12}).json()
    assert text == direct["choices"][0]["text"] != ""
    assert chunks[-1].usage.completion_tokens == 12
    assert wait_no_held(proc_pd["prefill"]) == 0


def test_chat_sync(client, proc_pd):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5)
    assert r.choices[0].message.content == expected_text("chat", {"messages": msgs}, 5)
    assert r.choices[0].message.role == "assistant"


def test_chat_stream_sync_with_usage(client, proc_pd):
    msgs = [{"role": "user", "content": "count"}]
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text("chat", {"messages": msgs}, 9)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9
    assert wait_no_held(proc_pd["prefill"]) == 0


def test_models_and_request_id(client, proc_pd):
    assert [m.id for m in client.models.list()] == [MODEL]
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1,
                                                      extra_headers={"X-Request-Id": "my-req-1"})
    assert raw.headers["x-request-id"] == "my-req-1"


def test_sdk_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e2:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    assert e2.value.body["param"] == "max_tokens"


async def test_async_sdk_concurrent(proc_pd):
    async with openai.AsyncOpenAI(base_url=proc_pd["url"] + "/v1", api_key="unused", max_retries=0) as c:
        async def one(i: int) -> None:
            prompt = f"async prompt {i}"
            if i % 2:
                r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
                assert r.choices[0].text == expected_text("completions", {"prompt": prompt}, 4)
            else:
                s = await c.chat.completions.create(model=MODEL, max_tokens=6, stream=True,
                                                    messages=[{"role": "user", "content": prompt}])
                text = "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
                assert text == expected_text("chat", {"messages": [{"role": "user", "content": prompt}]}, 6)

        await asyncio.gather(*(one(i) for i in range(40)))
    assert wait_no_held(proc_pd["prefill"]) == 0
