"""The KV ledger: every transfer ends in exactly one terminal state and nothing stays held."""

from __future__ import annotations

import asyncio
import os
import random
import time

import aiohttp
import pytest

from mesh.app import STATE, bound_port, create_app, start_site
from mesh.config import MeshConfig, Timeouts
from workers.mock import FleetSpec, MockFaults, MockFleet, MockTiming

BODY = {"model": "mock-model", "prompt": "ledger", "max_tokens": 4}


async def settle(pd_fleets, state, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = sum(len(p.holder) for f in pd_fleets for p in f.prefills)
        if held == 0 and not state.ledger.open and not state.background.tasks:
            return
        await asyncio.sleep(0.05)


async def test_lost_release_is_reclaimed_after_grace(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=1, decode=1, faults=MockFaults(drop_release=1.0)),
                       ledger_grace=0.5, ledger_interval=0.05)
    async with http.post(pd.url + "/v1/completions", json=BODY) as r:
        assert r.status == 200
    assert len(pd.fleet.prefills[0].holder) == 1  # the consumer's release was lost
    await settle([pd.fleet], pd.state, 3)
    assert len(pd.fleet.prefills[0].holder) == 0 and not pd.state.ledger.open
    assert pd.state.ledger.totals == {"RECLAIMED": 1}
    assert pd.state.ledger.recent[-1]["reason"] == "lost-release"


async def test_consumer_release_and_ttl_expiry_are_told_apart(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=1, decode=1, ttl_s=0.3), ledger_grace=5, ledger_interval=0.05)
    async with http.post(pd.url + "/v1/completions", json=BODY) as r:
        assert r.status == 200
    await settle([pd.fleet], pd.state, 3)
    assert pd.state.ledger.totals == {"RELEASED": 1}
    pd.fleet.decodes[0].faults = MockFaults(drop_release=1.0)
    async with http.post(pd.url + "/v1/completions", json={**BODY, "prompt": "expire me"}) as r:
        assert r.status == 200
    await settle([pd.fleet], pd.state, 3)  # the holder's TTL (0.3 s) fires before the mesh's grace (5 s)
    assert pd.state.ledger.totals == {"RELEASED": 1, "EXPIRED": 1}
    async with http.get(pd.url + "/kv/ledger") as r:
        led = await r.json()
    assert led["terminal"] == {"RELEASED": 1, "EXPIRED": 1} and led["held"] == {}
    assert [x["state"] for x in led["recent"]] == ["RELEASED", "EXPIRED"]
    async with http.get(pd.url + "/metrics") as r:
        text = await r.text()
    assert 'atomesh_kv_terminal_total{reason="holder:ttl",state="EXPIRED"} 1.0' in text
    assert "atomesh_kv_release_seconds_count 2.0" in text


async def test_restarted_mesh_adopts_and_reclaims_what_it_left_held(http):
    fleet = MockFleet(FleetSpec(prefill=1, decode=1, faults=MockFaults(crash_after_pull=1.0)))
    await fleet.start()
    pre, dec = fleet.mesh_workers()
    cfg = MeshConfig(port=0, prefill=pre, decode=dec, mesh_id="mesh-stable", decode_retries=0,
                     ledger_grace=0.3, ledger_interval=0.05,
                     timeouts=Timeouts(prefill=5, decode_first_byte=5, decode_idle=5, release=2))
    try:
        app = create_app(cfg)
        runner = await start_site(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{bound_port(runner)}"
        # the decode crashes after its pull: the mesh reclaims at once ("decode-failed")...
        async with http.post(url + "/v1/completions", json=BODY) as r:
            assert r.status == 502
        assert app[STATE].ledger.totals == {"RECLAIMED": 1}
        # ...but a mesh that dies first leaves the KV held: simulate it by holding one by hand
        p0 = fleet.prefills[0]
        p0.holder.hold("orphan-1", p0.engine.held_sequence("orphan-1", 3), mesh_id="mesh-stable")
        p0.holder.hold("other-mesh", p0.engine.held_sequence("other-mesh", 2), mesh_id="mesh-other")
        await runner.cleanup()
        await asyncio.sleep(0.4)
        app2 = create_app(cfg)
        runner2 = await start_site(app2, "127.0.0.1", 0)
        try:
            for _ in range(100):
                if "orphan-1" not in {t.transfer_id for t in fleet.prefills[0].holder.listing().transfers}:
                    break
                await asyncio.sleep(0.05)
            held = {t.transfer_id for t in fleet.prefills[0].holder.listing().transfers}
            assert held == {"other-mesh"}  # ours reclaimed; another mesh's left alone
            assert app2[STATE].ledger.adopted_totals == {"RECLAIMED": 1}
        finally:
            await runner2.cleanup()
    finally:
        await fleet.close()


@pytest.mark.timeout(120)
async def test_randomized_faults_leave_nothing_held(http):
    """Seeded: ~300 requests over pipelines of pp 1, 2 and 4 and decodes of tp 1 and 2, with clients
    leaving at random points, dropped write_done and release, crashing decodes and a slow stage."""
    rng = random.Random(int(os.environ.get("ATOMESH_FAULT_SEED", "20261202")))
    timing = MockTiming(prefill_ms_per_token=0.4, decode_ms_per_token=1.5, jitter=0.3)
    faults = MockFaults(drop_write_done=0.3, drop_release=0.15, crash_before_pull=0.04, crash_after_pull=0.04)
    fleets = [MockFleet(FleetSpec(prefill=1, decode=0, pp_size=pp, timing=timing, seed=pp, id_prefix=f"pp{pp}-",
                                  faults=faults if pp != 4 else MockFaults(drop_write_done=0.3, slow_stage=2,
                                                                           slow_stage_ms=40)))
              for pp in (1, 2, 4)]
    fleets += [MockFleet(FleetSpec(prefill=0, decode=2, tp_size=tp, timing=timing, seed=10 + tp, pull_deadline_s=0.5,
                                   id_prefix=f"tp{tp}-", faults=faults)) for tp in (1, 2)]
    for f in fleets:
        await f.start()
    pre = tuple(w for f in fleets for w in f.mesh_workers()[0])
    dec = tuple(w for f in fleets for w in f.mesh_workers()[1])
    grace = 1.0
    cfg = MeshConfig(port=0, prefill=pre, decode=dec, prefill_policy="random", decode_policy="random",
                     decode_retries=1, ledger_grace=grace, ledger_interval=0.1, health_interval=30,
                     unhealthy_after=10 ** 6,  # crashes are injected on purpose: keep every worker routable
                     timeouts=Timeouts(prefill=5, decode_first_byte=3, decode_idle=3, release=2))
    app = create_app(cfg)
    runner = await start_site(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{bound_port(runner)}"
    outcomes: dict[str, int] = {}
    n_requests = 300

    async def one(i: int) -> None:
        body = {**BODY, "prompt": f"request {i} " * rng.randint(2, 30), "max_tokens": rng.randint(2, 30),
                "stream": rng.random() < 0.5}
        leave_after = rng.choice([None, None, rng.uniform(0.001, 0.08)])
        try:
            async with asyncio.timeout(leave_after):
                async with http.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    key = str(r.status)
        except TimeoutError:
            key = "left"
        except aiohttp.ClientError:
            key = "transport"
        outcomes[key] = outcomes.get(key, 0) + 1

    sem = asyncio.Semaphore(24)

    async def limited(i: int) -> None:
        async with sem:
            await one(i)

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(limited(i) for i in range(n_requests)))
        led = app[STATE].ledger
        await settle(fleets, app[STATE], grace * 4 + 2)
        held = {p.id: len(p.holder) for f in fleets for p in f.prefills}
        print(f"\n{n_requests} requests in {time.monotonic() - t0:.1f}s; client outcomes {outcomes}; "
              f"terminal {dict(led.totals)}; adopted {dict(led.adopted_totals)}")
        assert held == {p.id: 0 for f in fleets for p in f.prefills}
        assert not led.open and not led.by_transfer
        handled = sum(s.value for m in app[STATE].metrics.registry.collect() if m.name == "atomesh_requests"
                      for s in m.samples if s.name == "atomesh_requests_total")
        repairs = sum(s.value for m in app[STATE].metrics.registry.collect() if m.name == "atomesh_retries"
                      for s in m.samples if s.name == "atomesh_retries_total" and s.labels["leg"] == "prefill")
        # exactly one terminal state for every pipeline a request was sent to: one per request the
        # mesh received, plus one per re-pair (a client may leave during a re-pair's backoff); a
        # client that gave up within a millisecond or two may leave before reaching the mesh at all
        assert sum(led.totals.values()) == led.began
        assert handled <= led.began <= handled + repairs
        assert n_requests - outcomes.get("left", 0) <= handled <= n_requests
        assert not led.adopted_totals
        for s in ("RELEASED", "RECLAIMED"):
            assert led.totals[s] > 0
        assert outcomes.get("200", 0) > n_requests // 3 and outcomes.get("left", 0) > 0
        for f in fleets:
            for p in f.prefills:
                assert p.engine.blocks.free == p.engine.blocks.num_blocks  # no block lost or double-freed
    finally:
        await runner.cleanup()
        for f in fleets:
            await f.close()
