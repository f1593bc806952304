"""SGLang behind the mesh (docs/protocol.md section 9), against a fake that bootstraps as SGLang's code
does (tests/fakes/sglang.py cites the files and commits): one room on both legs, an IPv6 bootstrap
host in brackets, lists of rooms for batches, n on completions refused clearly."""

from __future__ import annotations

import orjson
import pytest

from mesh.app import bound_port, create_app, start_site
from mesh.config import MeshConfig, Timeouts, make_worker
from tests.fakes.sglang import SglangServer
from workers.mock import first_token, token_ids, token_text

MODEL = "sglang-model"


@pytest.fixture
async def sglang_mesh():
    pre = await SglangServer("prefill", host="::1").start()   # an IPv6 prefill
    dec = await SglangServer("decode").start()
    cfg = MeshConfig(port=0, timeouts=Timeouts(prefill=10, decode_first_byte=10, decode_idle=10, release=2),
                     prefill=(make_worker("prefill", {"url": pre.url, "model": MODEL, "dialect": "sglang",
                                                      "bootstrap_port": pre.bootstrap_port}, 0),),
                     decode=(make_worker("decode", {"url": dec.url, "model": MODEL, "dialect": "sglang"}, 0),))
    runner = await start_site(create_app(cfg), "127.0.0.1", 0)
    yield pre, dec, f"http://127.0.0.1:{bound_port(runner)}"
    await runner.cleanup()
    await pre.close()
    await dec.close()


def text_of(prompt: str, n: int) -> str:
    return "".join(token_text(t) for t in token_ids(first_token(prompt), n))


@pytest.mark.parametrize("stream", [False, True])
async def test_both_legs_carry_the_same_room_and_a_bracketed_ipv6_host(sglang_mesh, http, stream):
    pre, dec, url = sglang_mesh
    body = {"model": MODEL, "prompt": "room for two", "max_tokens": 4, "stream": stream}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        raw = await r.read()
    if stream:
        text = "".join(orjson.loads(ev[6:])["choices"][0]["text"] for ev in raw.split(b"\n\n")
                       if ev.startswith(b"data: {"))
    else:
        text = orjson.loads(raw)["choices"][0]["text"]
    assert text == text_of("room for two", 4)
    (pb,), (db,) = pre.bodies, dec.bodies
    assert pb["bootstrap_room"] == db["bootstrap_room"] and 0 <= pb["bootstrap_room"] < 2 ** 63
    assert pb["bootstrap_host"] == db["bootstrap_host"] == "[::1]"
    assert pb["bootstrap_port"] == db["bootstrap_port"] == pre.bootstrap_port
    assert pb["stream"] is False and db["stream"] is stream
    assert dec.bootstrap_errors == [] and len(pre.route_gets) == 2  # the decode reached the bootstrap server
    assert await dec._bootstrap("::1", pre.bootstrap_port, 7)  # unbracketed, as before the fix: unreachable


async def test_a_batch_gets_one_room_per_prompt_on_both_legs(sglang_mesh, http):
    pre, dec, url = sglang_mesh
    prompts = ["one", "two", "three"]
    async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 3}) as r:
        assert r.status == 200, await r.text()
        got = await r.json()
    assert [c["text"] for c in got["choices"]] == [text_of(p, 3) for p in prompts]
    (pb,), (db,) = pre.bodies, dec.bodies
    assert pb["bootstrap_room"] == db["bootstrap_room"] and len(set(pb["bootstrap_room"])) == 3
    assert pb["bootstrap_host"] == ["[::1]"] * 3 and db["bootstrap_port"] == [pre.bootstrap_port] * 3


async def test_chat_n_gets_rooms_and_completions_n_a_clear_400(sglang_mesh, http):
    pre, dec, url = sglang_mesh
    async with http.post(url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2}) as r:
        assert r.status == 200, await r.text()
        assert [c["index"] for c in (await r.json())["choices"]] == [0, 1]
    assert len(dec.bodies[-1]["bootstrap_room"]) == 2
    async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2}) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["param"] == "n" and "n" in err["message"]
    assert len(pre.bodies) == 1  # refused before any leg
