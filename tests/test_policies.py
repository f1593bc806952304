"""Routing policies: the built-ins' behaviour and third-party policies through entry points."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import httpx
import pytest

import policies
from contract.snapshot import View
from mesh.config import make_worker
from mesh.request import ClientRequest
from tests.conftest import MESH_BIN, Proc


def workers(n: int, role: str = "prefill"):
    return tuple(make_worker(role, {"url": f"http://127.0.0.1:{9000 + i}", "id": f"w{i}", "model": "m"}, i)
                 for i in range(n))


def req(prompt: str = "p", kind: str = "completions", session: str | None = None, body=None) -> ClientRequest:
    b = body or ({"model": "m", "prompt": prompt} if kind == "completions" else
                 {"model": "m", "messages": [{"role": "user", "content": prompt}]})
    return ClientRequest(kind, "m", False, False, None, b, "rid", session)


def test_round_robin_cycles():
    ws = workers(3)
    p = policies.create("round_robin")
    assert [p.select(req(), View(ws, {})).id for _ in range(6)] == ["w0", "w1", "w2"] * 2


def test_random_is_seeded_and_covers_all():
    ws = workers(4)
    a = [policies.create("random", seed=7).select(req(), View(ws, {})).id for _ in range(1)]
    b = [policies.create("random", seed=7).select(req(), View(ws, {})).id for _ in range(1)]
    assert a == b
    p = policies.create("random", seed=1)
    assert {p.select(req(), View(ws, {})).id for _ in range(200)} == {"w0", "w1", "w2", "w3"}


def test_power_of_two_avoids_the_busiest():
    ws = workers(2)
    p = policies.create("power_of_two", seed=3)
    assert all(p.select(req(), View(ws, {"w0": 5, "w1": 1})).id == "w1" for _ in range(50))


def test_least_loaded_and_tie_rotation():
    ws = workers(3)
    p = policies.create("least_loaded")
    assert p.select(req(), View(ws, {"w0": 3, "w1": 0, "w2": 2})).id == "w1"
    assert {p.select(req(), View(ws, {})).id for _ in range(6)} == {"w0", "w1", "w2"}


def test_cache_aware_sticks_to_the_prefix_owner():
    ws = workers(4)
    p = policies.create("cache_aware", chunk_chars=16)
    doc = "a long shared system prompt that many requests start with. " * 4
    first = p.select(req(doc + "question one"), View(ws, {})).id
    # other load moves, but the prefix owner is still chosen while balance holds
    load = {w.id: 2 for w in ws}
    for i in range(10):
        assert p.select(req(doc + f"question {i}"), View(ws, load)).id == first
    # an unrelated prompt goes to the least loaded
    load = {"w0": 3, "w1": 3, "w2": 0, "w3": 3}
    assert p.select(req("something else entirely, nothing shared here at all"), View(ws, load)).id == "w2"


def test_cache_aware_chat_renders_every_message():
    ws = workers(3)
    p = policies.create("cache_aware", chunk_chars=8)
    sys_msg = {"role": "system", "content": "same system prompt for all"}
    a = {"model": "m", "messages": [sys_msg, {"role": "user", "content": "long conversation A " * 10}]}
    b = {"model": "m", "messages": [sys_msg, {"role": "user", "content": "other conversation B " * 10}]}
    wa = p.select(req(kind="chat", body=a), View(ws, {})).id
    wb = p.select(req(kind="chat", body=b), View(ws, {wa: 1})).id
    assert wa != wb  # the first message alone would have matched
    follow = {"model": "m", "messages": b["messages"] + [{"role": "assistant", "content": "ok"}]}
    assert p.select(req(kind="chat", body=follow), View(ws, {wa: 0, wb: 0})).id == wb


def test_cache_aware_balance_guard_and_lru():
    ws = workers(2)
    p = policies.create("cache_aware", chunk_chars=4, balance_abs=4, balance_rel=1.5, max_chunks_per_worker=8)
    owner = p.select(req("shared prefix text"), View(ws, {})).id
    other = next(w.id for w in ws if w.id != owner)
    assert p.select(req("shared prefix text"), View(ws, {owner: 20, other: 1})).id == other
    assert p.indexed_chunks(owner) <= 8
    p.select(req("x" * 400), View(ws, {other: 9}))  # evicts the owner's older chunks
    assert p.indexed_chunks(owner) == 8
    p.retain([other])
    assert p.indexed_chunks(owner) == 0


def test_consistent_hash_sticky_and_minimal_movement():
    ws = workers(5)
    p = policies.create("consistent_hash")
    keys = [f"user-{i}" for i in range(500)]
    before = {k: p.select(req(session=k), View(ws, {})).id for k in keys}
    assert all(p.select(req(session=k), View(ws, {})).id == before[k] for k in keys[:50])
    after = {k: p.select(req(session=k), View(ws[:4], {})).id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "w4" for k in moved)
    assert 0.1 < len(moved) / len(keys) < 0.35
    assert p.select(req(session=None), View(ws, {"w0": 1, "w1": 1, "w2": 0, "w3": 1, "w4": 1})).id == "w2"


def test_unknown_policy_lists_available():
    with pytest.raises(ValueError, match="available: .*cache_aware"):
        policies.create("nope")


PLUGIN = '''
from policies.base import PolicyBase

class LastOne(PolicyBase):
    """Always the last candidate: easy to observe."""
    name = "last_one"

    def __init__(self, **options):
        self.options = options

    def select(self, request, view):
        return view.workers[-1]
'''


def install_plugin(root: Path) -> Path:
    """A real installed distribution: a module plus its .dist-info with entry_points.txt."""
    (root / "atomesh_last_one.py").write_text(PLUGIN)
    info = root / "atomesh_last_one-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: atomesh-last-one\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[atomesh.policies]\nlast_one = atomesh_last_one:LastOne\n")
    return root


def test_entry_point_policy_in_process(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(install_plugin(tmp_path)))
    assert "last_one" in policies.available()
    p = policies.create("last_one", k=1)
    assert p.select(req(), View(workers(3), {})).id == "w2"
    sys.modules.pop("atomesh_last_one", None)


def test_entry_point_policy_picked_by_name_in_mesh(tmp_path):
    plugin_dir = install_plugin(tmp_path)
    fleet = Proc([MESH_BIN, "mock-fleet", "--prefill", "3", "--decode", "1"], "ready")
    try:
        pre = [x.split()[1] for x in fleet.lines if x.startswith("prefill ")]
        dec = [x.split()[1] for x in fleet.lines if x.startswith("decode ")]
        args = [MESH_BIN, "serve", "--port", "0", "--prefill-policy", "last_one", "--decode", dec[0]]
        for u in pre:
            args += ["--prefill", u]
        mesh = Proc(args, "mesh ", env={"PYTHONPATH": str(plugin_dir)})
        try:
            url = mesh.lines[-1].split()[1]
            for i in range(6):
                r = httpx.post(url + "/v1/completions", json={"model": "mock-model", "prompt": f"p{i}", "max_tokens": 2})
                assert r.status_code == 200
            counts = collections.Counter({u: httpx.get(u + "/health").json()["requests_total"] for u in pre})
            assert counts[pre[-1]] == 6 and counts[pre[0]] == counts[pre[1]] == 0
        finally:
            assert mesh.stop() == 0
    finally:
        fleet.stop()


def pipelines(n: int, num_blocks: int = 100, block_size: int = 16):
    return tuple(make_worker("prefill", {"url": f"http://127.0.0.1:{9100 + i}", "id": f"p{i}", "model": "m",
                                         "num_blocks": num_blocks, "block_size": block_size}, i) for i in range(n))


def test_kv_pressure_prefers_most_free_and_refuses_what_cannot_fit():
    from contract.errors import InsufficientKV, InvalidRequest

    ws = pipelines(3)
    p = policies.create("kv_pressure")
    prompt = "x" * (16 * 10)  # 10 blocks
    assert p.select(req(prompt), View(ws, {}, {"p0": 50, "p1": 80, "p2": 20})).id == "p1"
    # p1 has the most free, but not enough for a 60-block prompt... nor anyone else except p0
    big = "y" * (16 * 60)
    assert p.select(req(big), View(ws, {}, {"p0": 70, "p1": 59, "p2": 65})).id == "p0"
    with pytest.raises(InsufficientKV):
        p.select(req(big), View(ws, {}, {"p0": 10, "p1": 10, "p2": 10}))
    with pytest.raises(InvalidRequest) as e:
        p.select(req("z" * (16 * 101)), View(ws, {}, {}))
    assert e.value.param == "prompt"
    # ties on free blocks go to the less loaded
    assert p.select(req(prompt), View(ws, {"p0": 3, "p1": 0, "p2": 3}, {"p0": 40, "p1": 40, "p2": 40})).id == "p1"


async def test_kv_pressure_in_the_mesh_tracks_blocks(make_pd, http):
    import asyncio

    from workers.mock import FleetSpec, MockFaults

    pd = await make_pd(FleetSpec(prefill=2, decode=1, num_blocks=64, pp_size=2,
                                 faults=MockFaults(slow_stage=1, slow_stage_ms=800)),
                       prefill_policy="kv_pressure", ledger_interval=0.05, ledger_grace=1.0)
    assert pd.state.fleet.kv_free == {"mock-prefill-0": 64, "mock-prefill-1": 64}

    async def one(i):
        async with http.post(pd.url + "/v1/completions", json={"model": "mock-model", "prompt": f"{i}" * 16 * 20,
                                                               "max_tokens": 2}) as r:
            return r.status

    tasks = [asyncio.create_task(one(i)) for i in range(3)]
    await asyncio.sleep(0.3)  # three prefills of 20 blocks held, their pulls slowed by stage 1
    free = pd.state.fleet.kv_free
    assert sum(free.values()) == 128 - 60 and min(free.values()) >= 64 - 40  # spread by free blocks
    # a prompt of 45 blocks fits nowhere while those are held (free: 24 and 44)
    async with http.post(pd.url + "/v1/completions", json={"model": "mock-model", "prompt": "q" * 16 * 45,
                                                           "max_tokens": 2}) as r:
        assert r.status == 503 and (await r.json())["error"]["code"] == "kv_exhausted"
    assert await asyncio.gather(*tasks) == [200, 200, 200]
    assert await pd.wait_released() == 0
    for _ in range(100):
        if sum(pd.state.fleet.kv_free.values()) == 128:
            break
        await asyncio.sleep(0.02)
    assert sum(pd.state.fleet.kv_free.values()) == 128


def test_cache_aware_long_prompts_have_few_keys_and_keep_their_prefixes():
    """Chunks grow with their position (issue 20): a 1 MB prompt has ~180 keys, not 16,000; a
    prefix's keys are the longer prompt's first keys; a long shared prefix still finds its owner."""
    from policies.cache_aware import chunk_keys

    doc = "".join(chr(97 + (i * 7919) % 26) for i in range(1_000_000))
    keys, ends = chunk_keys(doc, 64)
    assert len(keys) < 200 and ends[-1] == len(doc) and ends == sorted(ends)
    for cut in (100, 4096, 70_000, 300_001):
        k2, e2 = chunk_keys(doc[:cut], 64)
        whole = sum(1 for e in ends if e <= cut)   # the chunks wholly inside the prefix
        assert k2[:whole] == keys[:whole] and e2[-1] == cut
    ws = workers(4)
    p = policies.create("cache_aware")
    owner = p.select(req(doc[:300_000] + " question A"), View(ws, {})).id
    load = {w.id: 1 for w in ws}
    assert all(p.select(req(doc[:300_000] + f" question {i}"), View(ws, load)).id == owner for i in range(5))
    # a prompt matching less than half its characters goes to the least loaded worker
    other = p.select(req(doc[:1000] + "x" * 5000), View(ws, {owner: 3, **{w.id: 0 for w in ws if w.id != owner}}))
    assert other.id != owner


def test_cache_aware_index_slots_are_reused_after_retain():
    ws = workers(3)
    p = policies.create("cache_aware", chunk_chars=4)
    for i, w in enumerate(ws):
        p._learn(w.id, [i, 100 + i])
    p.retain([ws[0].id, ws[2].id])
    assert p.indexed_chunks(ws[1].id) == 0 and 1 not in p._index and 101 not in p._index
    p._learn("w9", [1])                      # the freed slot, not a new bit
    assert sorted(p._slot.values()) == [0, 1, 2]
    assert p.select(req("pppp"), View(ws, {})).id in {w.id for w in ws}
