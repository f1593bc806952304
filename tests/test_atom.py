"""ATOM behind `mesh serve` (docs/protocol.md section 9), against fakes that answer as ATOM's source does
(tests/fakes/atom.py cites the files and commit), registered from TOML and from etcd; the same
correctness checks against this project's mock fleet in the atom dialect."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import MESH_BIN, Proc
from tests.fakes.atom import AtomServer

MODEL = "atom-model"


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for ev in raw.split(b"\n\n"):
        if ev.startswith(b"data: {"):
            out.append(orjson.loads(ev[6:]))
    return out


def joined(events: list[dict[str, Any]], kind: str) -> str:
    parts = []
    for e in events:
        for c in e.get("choices", []):
            parts.append((c.get("delta") or {}).get("content") or "" if kind == "chat" else c.get("text") or "")
    return "".join(parts)


def body_for(kind: str, prompt: str, stream: bool, n_tokens: int = 6) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "max_tokens": n_tokens, "temperature": 0, "stream": stream}
    if kind == "chat":
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
    return b


async def post(http: aiohttp.ClientSession, url: str, kind: str, body: dict[str, Any]) -> tuple[int, bytes]:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    async with http.post(url + path, json=body) as r:
        return r.status, await r.read()


async def wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def ledger(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/kv/ledger") as r:
        return await r.json()


class AtomMesh:
    def __init__(self, pre: AtomServer, decs: list[AtomServer], mesh: Proc, url: str) -> None:
        self.pre, self.decs, self.mesh, self.url = pre, decs, mesh, url


def toml_for(pre: AtomServer, decs: list[AtomServer], dp_size: int) -> str:
    out = ["[mesh]", "decode_retries = 0", "health_interval = 0.5",
           "[mesh.timeouts]", "prefill = 10", "decode_first_byte = 10",
           "[[prefill]]", 'id = "atom-p"', f'url = "{pre.url}"', f'model = "{MODEL}"', f"dp_size = {dp_size}"]
    for i, d in enumerate(decs):
        out += ["[[decode]]", f'id = "atom-d{i}"', f'url = "{d.url}"', f'model = "{MODEL}"']
    return "\n".join(out) + "\n"


@pytest.fixture
async def atom_mesh(tmp_path):
    pre = await AtomServer("prefill", dp_size=2, lookup_timeout=2.0).start()
    decs = [await AtomServer("decode").start()]
    cfg = tmp_path / "mesh.toml"
    cfg.write_text(toml_for(pre, decs, 2))
    mesh = await asyncio.to_thread(Proc, [MESH_BIN, "serve", "--port", "0", "--config", str(cfg),
                                          "--ledger-grace", "0.5"], "mesh ")
    am = AtomMesh(pre, decs, mesh, mesh.lines[-1].split()[1])
    yield am
    assert await asyncio.to_thread(mesh.stop) == 0
    for s in (pre, *decs):
        await s.close()


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_atom_pd_equals_atom_alone_stream_and_not(atom_mesh, http, kind):
    am = atom_mesh
    dec = am.decs[0]
    for i in range(4):  # round robin over the prefill's two DP ranks
        prompt = f"atom {kind} {i}"
        st, alone = await post(http, dec.url, kind, body_for(kind, prompt, False))
        assert st == 200
        want = orjson.loads(alone)
        st, got = await post(http, am.url, kind, body_for(kind, prompt, False))
        assert st == 200, got
        g = orjson.loads(got)
        key = "message" if kind == "chat" else "text"
        pick = (lambda d: d["choices"][0]["message"]["content"]) if kind == "chat" else (
            lambda d: d["choices"][0]["text"])
        assert pick(g) == pick(want), key
        assert g["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 6
        st, raw = await post(http, am.url, kind, body_for(kind, prompt, True))
        assert st == 200 and raw.endswith(b"data: [DONE]\n\n")
        evs = sse_events(raw)
        # the first token exactly once: the decode emits T0 itself, the mesh sent nothing early
        assert joined(evs, kind) == pick(want)
        assert len({e["id"] for e in evs}) == 1  # one stream id, the engine's own
        if kind == "chat":
            roles = [c for e in evs for c in e["choices"] if (c.get("delta") or {}).get("role")]
            assert len(roles) == 1
    assert dec.pull_failures == 0 and dec.pulls == 8
    assert am.pre.held_transfers() == 0 and am.pre.held_blocks() == 0
    assert not [p for p in am.pre.paths + dec.paths if p.startswith("/kv/")]  # no holder API asked for


async def test_every_prefill_field_reaches_the_decode_typed_and_enriched(atom_mesh, http):
    am = atom_mesh
    dec = am.decs[0]
    for i in range(2):
        st, raw = await post(http, am.url, "completions", {**body_for("completions", f"fields {i}", True),
                                                           "stop": "never", "max_completion_tokens": 5})
        assert st == 200
    prefills = [b for b in am.pre.bodies]
    for pb in prefills:  # ATOM router `inject_prefill_fields`
        assert pb["stream"] is False and pb["max_tokens"] == 1 and pb["max_completion_tokens"] == 1
        assert "stream_options" not in pb and pb["stop"] == ["never"]
        assert pb["kv_transfer_params"]["do_remote_decode"] is True
        assert pb["kv_transfer_params"]["do_remote_prefill"] is False
    decoded = [b["kv_transfer_params"] for b in dec.bodies]
    assert [o["dp_rank"] for o in am.pre.outputs] == [0, 1]   # both DP ranks served one
    for out, got in zip(am.pre.outputs, decoded):
        for k, v in out.items():
            if k == "do_remote_prefill":
                continue
            assert k in got and got[k] == v and type(got[k]) is type(v), k
        assert type(got["transfer_id"]) is int
        # enrich_decode_kv: remote_dp_rank = the prefill's dp_rank, its dp and tp sizes
        assert got["remote_dp_rank"] == out["dp_rank"] and got["remote_dp_size"] == 2
        assert got["remote_tp_size"] == 1
        assert "response_meta" not in got and "first_token_early" not in got
    for b in dec.bodies:
        assert b["max_completion_tokens"] == 5 and b["stop"] == ["never"] and b["stream"] is True
    assert dec.pull_failures == 0 and am.pre.held_blocks() == 0


async def test_list_prompt_is_one_pd_pair_per_prompt_merged(atom_mesh, http):
    am = atom_mesh
    prompts = ["first of two", "second of two"]
    alone = []
    for p in prompts:
        st, raw = await post(http, am.decs[0].url, "completions", body_for("completions", p, False))
        alone.append(orjson.loads(raw))
    st, raw = await post(http, am.url, "completions", {**body_for("completions", "", False), "prompt": prompts})
    assert st == 200, raw
    got = orjson.loads(raw)
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert [c["text"] for c in got["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert got["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert got["usage"]["completion_tokens"] == 12
    st, raw = await post(http, am.url, "completions", {**body_for("completions", "", True), "prompt": prompts,
                                                       "stream_options": {"include_usage": True}})
    assert st == 200
    evs = sse_events(raw)
    by_index: dict[int, str] = {}
    for e in evs:
        for c in e["choices"]:
            by_index[c["index"]] = by_index.get(c["index"], "") + c["text"]
    assert by_index == {0: alone[0]["choices"][0]["text"], 1: alone[1]["choices"][0]["text"]}
    assert len({e["id"] for e in evs}) == 1 and evs[-1]["usage"]["completion_tokens"] == 12
    assert am.pre.held_blocks() == 0


async def test_decode_failing_before_its_pull_is_drained(atom_mesh, http):
    am = atom_mesh
    dec = am.decs[0]
    dec.fail_next = 1
    st, raw = await post(http, am.url, "completions", body_for("completions", "doomed decode", False))
    assert st == 502, raw
    await wait_for(lambda: am.pre.held_blocks() == 0)   # freed by the drain leg
    assert dec.pulls == 1 and dec.pull_failures == 0
    drain_bodies = [b for b in dec.bodies if b.get("kv_transfer_params", {}).get("do_remote_prefill")]
    assert drain_bodies[-1]["max_tokens"] == 1 and drain_bodies[-1]["stream"] is False
    led = await ledger(http, am.url)
    assert led["terminal"].get("RECLAIMED") == 1 and led["recent"][-1]["reason"] == "drained"
    assert "EXPIRED" not in led["terminal"] and "UNRECLAIMABLE" not in led["terminal"]


async def test_client_leaving_between_the_legs_is_drained(atom_mesh, http):
    am = atom_mesh
    dec = am.decs[0]
    dec.decode_delay = 0.6   # the decode leg is open, it has not pulled yet
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(am.url + "/v1/completions", json=body_for("completions", "leaving early", False),
                             timeout=aiohttp.ClientTimeout(total=0.3)) as r:
            await r.read()
    await wait_for(lambda: dec.aborted == 1)          # ATOM aborted the cut decode: no pull
    await wait_for(lambda: am.pre.held_blocks() == 0)  # the mesh's drain leg pulled it
    assert dec.pulls == 1
    await wait_for(lambda: True)
    led = await ledger(http, am.url)
    assert led["terminal"] == {"RECLAIMED": 1} and led["recent"][-1]["reason"] == "drained"


async def test_client_leaving_during_the_prefill_is_drained_after_it(atom_mesh, http):
    am = atom_mesh
    am.pre.prefill_delay = 0.8
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(am.url + "/v1/completions", json=body_for("completions", "gone in prefill", True),
                             timeout=aiohttp.ClientTimeout(total=0.3)) as r:
            await r.read()
    await wait_for(lambda: len(am.pre.outputs) == 1)   # the prefill ran to its end and holds
    await wait_for(lambda: am.pre.held_blocks() == 0)
    assert am.decs[0].pulls == 1
    led = await ledger(http, am.url)
    assert led["terminal"] == {"RECLAIMED": 1}


async def test_atom_registered_in_etcd(etcd, http, tmp_path):
    pre = await AtomServer("prefill", dp_size=2, lookup_timeout=2.0).start()
    dec = await AtomServer("decode").start()
    procs: list[Proc] = []
    try:
        for args in (["--role", "prefill", "--url", pre.url, "--dp-size", "2"], ["--role", "decode", "--url", dec.url]):
            procs.append(await asyncio.to_thread(Proc, [MESH_BIN, "register", "--etcd", etcd.url, "--model", MODEL,
                                                        "--dialect", "atom", "--ttl", "3", *args], "registered"))
        mesh = await asyncio.to_thread(Proc, [MESH_BIN, "serve", "--port", "0", "--etcd", etcd.url], "mesh ")
        procs.append(mesh)
        url = mesh.lines[-1].split()[1]
        await wait_for_ready(http, url)
        for i in range(2):
            st, raw = await post(http, url, "chat", body_for("chat", f"etcd {i}", True))
            assert st == 200
            evs = sse_events(raw)
            assert len({e["id"] for e in evs}) == 1
        got = [b["kv_transfer_params"] for b in dec.bodies]
        assert [g["remote_dp_rank"] for g in got] == [0, 1] and {g["remote_dp_size"] for g in got} == {2}
        assert dec.pull_failures == 0 and pre.held_blocks() == 0
    finally:
        for p in procs[::-1]:
            await asyncio.to_thread(p.stop)
        await pre.close()
        await dec.close()


async def wait_for_ready(http: aiohttp.ClientSession, url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with http.get(url + "/ready") as r:
            if r.status == 200:
                return
        await asyncio.sleep(0.1)
    raise AssertionError("mesh never ready")


async def test_mock_fleet_in_the_atom_dialect_passes_the_same_checks(make_pd, http):
    """This project's protocol (holder API, first token early) through the same flow."""
    from workers.mock import FleetSpec

    pd = await make_pd(FleetSpec(prefill=1, decode=1))
    for kind in ("completions", "chat"):
        body = body_for(kind, f"mock {kind}", False)
        body["model"] = "mock-model"
        st, whole = await post(http, pd.url, kind, body)
        assert st == 200
        st, raw = await post(http, pd.url, kind, {**body, "stream": True})
        evs = sse_events(raw)
        assert len({e["id"] for e in evs}) == 1
        text = orjson.loads(whole)["choices"][0]
        assert joined(evs, kind) == (text["message"]["content"] if kind == "chat" else text["text"])
        if kind == "chat":
            assert sum(1 for e in evs for c in e["choices"] if (c.get("delta") or {}).get("role")) == 1
    st, raw = await post(http, pd.url, "completions", {"model": "mock-model", "prompt": ["a", "b"], "max_tokens": 3})
    assert st == 200 and [c["index"] for c in orjson.loads(raw)["choices"]] == [0, 1]
    assert await pd.wait_released() == 0
    assert pd.state.ledger.began == 6  # the holder API: every transfer on the ledger


async def test_capabilities_learnt_from_load_or_none(make_pd, http):
    """docs/protocol.md section 8: a static `--prefill URL` worker of this project is known by its /load
    answer; an ATOM engine has no /load report, declares nothing and is probed at /health."""
    from contract.protocol import OWN_CAPABILITIES
    from mesh.config import make_worker
    from workers.mock import FleetSpec

    atom = await AtomServer("decode", model="mock-model").start()
    try:
        base = await make_pd(FleetSpec(prefill=1, decode=1))
        pw = make_worker("prefill", {"url": base.fleet.prefills[0].url}, 0)   # no capabilities given
        dw = make_worker("decode", {"url": base.fleet.decodes[0].url}, 0)
        aw = make_worker("decode", {"url": atom.url, "id": "atom-d"}, 1)
        pd = await make_pd(FleetSpec(prefill=1, decode=1), prefill=(pw,), decode=(dw, aw))
        caps = {w.id: w.record.capabilities for w in pd.state.fleet.workers()}
        assert caps == {pw.id: OWN_CAPABILITIES, dw.id: OWN_CAPABILITIES, "atom-d": ()}
        assert pd.state.fleet.healthy("atom-d")
        assert atom.paths.count("/load") == 1 and "/health" in atom.paths   # asked once, then /health
        async with http.get(pd.url + "/workers") as r:
            rows = {w["id"]: w for w in (await r.json())["workers"]}
        assert rows["atom-d"]["healthy"] and rows["atom-d"]["record"]["capabilities"] == []
    finally:
        await atom.close()


def test_register_refuses_unknown_capabilities_and_misplaced_dp_size():
    import subprocess

    base = [MESH_BIN, "register", "--etcd", "http://127.0.0.1:1", "--model", "m", "--url", "http://127.0.0.1:9"]
    r = subprocess.run([*base, "--role", "decode", "--capability", "teleport"], capture_output=True, text=True)
    assert r.returncode == 2 and "teleport" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([*base, "--role", "decode", "--dp-size", "2"], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "--dp-size is for --role prefill" in r.stderr and "Traceback" not in r.stderr
