"""Mesh <-> worker authentication (issue 16 item 2), written as the attacks: someone with network
reach but without the worker token cannot list or free a transfer (`/kv/*`), cannot make a
decode pull KV from a "stage" of their choosing (a PD-flagged completion), and cannot ask a stage
to write a held transfer anywhere or free it over the side channel. The mesh, holding the token,
serves PD as before. The mock fleet runs the real adapters, so these are the real workers' checks
(tests/test_faults_real.py runs the same on real engine processes)."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import msgpack
import orjson
import pytest
import zmq
import zmq.asyncio

from contract.errors import ProtocolError
from contract.protocol import ConsumerRank, DecodeRecord, KVRequestParams, Release, WriteRequest, encode_frame
from mesh.etcd_registry import check_record
from workers.kv.sidechannel import release_mac, write_mac
from workers.mock import FleetSpec

TOKEN = "worker-token-for-tests-0123456789"
BODY = {"model": "mock-model", "prompt": "the token guards the KV", "max_tokens": 6}


@pytest.fixture
async def pd(make_pd, monkeypatch):
    monkeypatch.setenv("ATOMESH_WORKER_TOKEN", TOKEN)   # the mesh sends it to records naming it
    return await make_pd(FleetSpec(prefill=1, decode=1, pp_size=2, worker_token=TOKEN))


async def _hold_one(http: aiohttp.ClientSession, prefill_url: str, headers: dict[str, str]) -> dict:
    """A PD prefill leg, as the mesh sends it: the transfer is held afterwards."""
    body = {**BODY, "max_tokens": 1, "kv_transfer_params": KVRequestParams(
        remote_engine_id="d", remote_host="127.0.0.1", remote_port=1, remote_handshake_port=1,
        remote_tp_size=1).encode()}
    async with http.post(prefill_url + "/v1/completions", json=body, headers=headers) as r:
        return {"status": r.status, **orjson.loads(await r.read())}


async def test_the_mesh_holding_the_token_serves_pd(pd, http):
    for stream in (False, True):
        async with http.post(pd.url + "/v1/completions", json={**BODY, "stream": stream}) as r:
            assert r.status == 200, await r.text()
            raw = await r.read()
        assert raw.count(b" t") >= 6
    assert await pd.wait_released() == 0
    stage0 = pd.fleet.prefills[0].channels[0]
    assert stage0.stats.unauthenticated == 0 and stage0.stats.releases_received == 2


async def test_kv_routes_refuse_a_caller_without_the_token(pd, http):
    pre = pd.fleet.prefills[0]
    held = await _hold_one(http, pre.url, {"Authorization": f"Bearer {TOKEN}"})
    tid = held["kv_transfer_params"]["transfer_id"]
    for headers in ({}, {"Authorization": "Bearer not-the-token-at-all-000"}, {"Authorization": TOKEN}):
        async with http.get(pre.url + "/kv/held", headers=headers) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_worker_token"
        async with http.post(pre.url + "/kv/release", json={"transfer_id": tid}, headers=headers) as r:
            assert r.status == 401
        # a PD prefill leg holds KV for whoever asks: the mesh's only
        assert (await _hold_one(http, pre.url, headers))["status"] == 401
    assert pre.holder.blocks_of(tid) is not None and len(pre.holder) == 1   # still held, nothing new
    async with http.get(pre.url + "/kv/held", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 200 and [t["transfer_id"] for t in (await r.json())["transfers"]] == [tid]
    async with http.post(pre.url + "/kv/release", json={"transfer_id": tid},
                         headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert (await r.json())["released"] is True
    assert pre.engine.blocks.free == pre.engine.blocks.num_blocks
    # without kv_transfer_params a worker is the engine alone: served without the token
    async with http.post(pre.url + "/v1/completions", json=BODY) as r:
        assert r.status == 200


async def _router() -> tuple[zmq.asyncio.Socket, int]:
    s = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    return s, s.bind_to_random_port("tcp://127.0.0.1")


async def _nothing_arrives(sock: zmq.asyncio.Socket, wait: float = 0.5) -> bool:
    return await sock.poll(int(wait * 1000)) == 0


async def test_a_decode_pulls_for_the_mesh_only(pd, http):
    """A PD-flagged completion names the stages the decode pulls from and writes KV with: without
    the token the decode refuses it before it sends anything to the named "stage"."""
    fake_stage, port = await _router()
    try:
        kvp = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "evil",
               "remote_host": "127.0.0.1", "remote_port": port, "remote_handshake_port": port,
               "remote_block_ids": [0, 1], "remote_pp_size": 1, "tp_size": 1, "dp_rank": 0,
               "transfer_id": "t-evil", "first_token_id": 5,
               "stages": [{"pp_rank": 0, "host": "127.0.0.1", "port": port, "layers": [0, 32]}]}
        dec = pd.fleet.decodes[0]
        async with http.post(dec.url + "/v1/completions", json={**BODY, "prompt": "x" * 20,
                                                               "kv_transfer_params": kvp}) as r:
            assert r.status == 401
        assert await _nothing_arrives(fake_stage)
        assert dec.engine.blocks.free == dec.engine.blocks.num_blocks
    finally:
        fake_stage.close(0)


async def test_a_stage_serves_and_frees_only_signed_side_channel_requests(pd, http):
    """Someone who learnt a held transfer's id (and its blocks) asks stage 0 and stage 1 to write it
    into their own segment, and to free it: unsigned, or signed with another token, nothing is
    written, no write_done comes back, the transfer stays held; each drop is counted."""
    pre = pd.fleet.prefills[0]
    held = await _hold_one(http, pre.url, {"Authorization": f"Bearer {TOKEN}"})
    kv = held["kv_transfer_params"]
    tid, blocks = kv["transfer_id"], tuple(kv["remote_block_ids"])
    notify, nport = await _router()
    ctx = zmq.asyncio.Context.instance()
    try:
        req = WriteRequest(request_id="r", transfer_id=tid, src_block_ids=blocks, dst_block_ids=blocks,
                           ranks=(ConsumerRank(tp_rank=0, segment="attacker", head_start=0, head_end=8),),
                           notify_host="127.0.0.1", notify_port=nport, write_nonce=1)
        forged = [req, dataclasses.replace(req, extra={"auth": write_mac("another-token-0123456789", req)}),
                  dataclasses.replace(req, extra={"auth": "0" * 64})]
        for st in pd.fleet.prefills[0].stage_addrs():
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(f"tcp://127.0.0.1:{st.port}")
            for f in forged:
                await d.send(encode_frame(f))
            await d.send(encode_frame(Release(transfer_id=tid, tp_rank=0)))
            await d.send(encode_frame(Release(transfer_id=tid, tp_rank=0,
                                              auth=release_mac("another-token-0123456789", tid, 0))))
            await d.send(msgpack.packb(["release", {"transfer_id": tid, "tp_rank": 0, "auth": 5}]))
            await asyncio.sleep(0.1)
            d.close(0)
        assert await _nothing_arrives(notify)
        assert pre.holder.blocks_of(tid) == blocks
        for ch in pre.channels.values():
            assert ch.stats.write_requests == 0 and ch.stats.releases_received == 0
            assert ch.stats.unauthenticated + ch.stats.bad_frames == 6
        # the mesh's own request still goes through afterwards
        async with http.post(pd.url + "/v1/completions", json=BODY) as r:
            assert r.status == 200
    finally:
        notify.close(0)
        async with http.post(pre.url + "/kv/release", json={"transfer_id": tid},
                             headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200
    assert await pd.wait_released() == 0


def test_a_record_can_name_only_an_atomesh_variable_as_its_token():
    """A record written by someone else cannot have the mesh send it, say, a cloud credential."""
    ok = DecodeRecord(id="d", model="m", url="http://127.0.0.1:1", api_key_env="ATOMESH_WORKER_TOKEN")
    assert check_record(ok, "decode") is ok
    for bad in ("HOME", "AWS_SECRET_ACCESS_KEY", "ATOMESH_", "atomesh_x", "ATOMESH_X-Y", "ATOMESH_\u00c9"):
        with pytest.raises(ProtocolError, match="api_key_env"):
            check_record(dataclasses.replace(ok, api_key_env=bad), "decode")


def test_a_short_token_is_refused():
    with pytest.raises(ValueError, match="16"):
        FleetSpec(worker_token="short")


async def test_a_prefill_naming_stages_not_its_own_sends_no_decode_there(pd, http):
    """A prefill (compromised, or a stale answer) names a "stage" that is not in its pipeline's
    record: the mesh refuses the hand-off before the decode leg, so the decode never connects there
    with its ranks' segments; the transfer it held is released and the client's answer says why."""
    fake_stage, port = await _router()
    pre = pd.fleet.prefills[0]
    real = pre.stage_addrs

    def lying() -> tuple:
        return tuple(dataclasses.replace(s, port=port) if s.pp_rank == 1 else s for s in real())

    pre.stage_addrs = lying   # type: ignore[method-assign]
    try:
        async with http.post(pd.url + "/v1/completions", json=BODY) as r:
            body = await r.json()
            assert r.status == 502 and "not a registered stage" in body["error"]["message"], body
        assert await _nothing_arrives(fake_stage)
        assert pd.fleet.decodes[0].pulls == pd.fleet.decodes[0].pulls_failed == 0   # no decode leg was sent
    finally:
        fake_stage.close(0)
        pre.stage_addrs = real   # type: ignore[method-assign]
    assert await pd.wait_released() == 0
    dec = pd.fleet.decodes[0]
    assert dec.engine.blocks.free == dec.engine.blocks.num_blocks
    async with http.post(pd.url + "/v1/completions", json=BODY) as r:   # the true stages still serve
        assert r.status == 200
