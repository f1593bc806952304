"""CLI forms, TOML configuration, regular mode and the operations routes."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from contract.errors import ConfigError
from mesh.config import MeshConfig, make_worker
from tests.conftest import MESH_BIN, Proc
from workers.mock import FleetSpec


def test_mock_fleet_prints_urls_then_ready_and_stops_on_sigterm():
    fleet = Proc([MESH_BIN, "mock-fleet", "--prefill", "2", "--decode", "3", "--pp-size", "2"], "ready")
    try:
        kinds = [line.split()[0] for line in fleet.lines]
        assert kinds == ["prefill", "prefill", "decode", "decode", "decode", "ready"]
        for line in fleet.lines[:-1]:
            assert httpx.get(line.split()[1] + "/health").json()["status"] == "ok"
    finally:
        assert fleet.stop() == 0


def test_serve_from_toml_config(tmp_path):
    fleet = Proc([MESH_BIN, "mock-fleet", "--prefill", "1", "--decode", "1", "--model", "toml-model"], "ready")
    try:
        pre, dec = (line.split()[1] for line in fleet.lines[:2])
        cfg = tmp_path / "mesh.toml"
        cfg.write_text(f"""
[mesh]
prefill_policy = "round_robin"
decode_policy = "power_of_two"
decode_retries = 2
[mesh.timeouts]
prefill = 30.0
[[prefill]]
id = "pipe-a"
url = "{pre}"
model = "toml-model"
pp_size = 1
[[decode]]
id = "dec-a"
url = "{dec}"
""")
        mesh = Proc([MESH_BIN, "serve", "--port", "0", "--config", str(cfg)], "mesh ")
        try:
            url = mesh.lines[-1].split()[1]
            ws = httpx.get(url + "/workers").json()["workers"]
            assert {(w["id"], w["model"], w["healthy"]) for w in ws} == {("pipe-a", "toml-model", True),
                                                                        ("dec-a", "toml-model", True)}
            r = httpx.post(url + "/v1/completions", json={"model": "toml-model", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
        finally:
            assert mesh.stop() == 0
    finally:
        fleet.stop()


@pytest.mark.parametrize("args,msg", [
    (["serve", "--port", "0"], "no workers"),
    (["serve", "--port", "0", "--prefill", "ftp://x"], "prefill[0].url"),
    (["serve", "--port", "0", "--prefill", "http://h:1", "--decode", "http://h:2", "--prefill-policy", "nope"],
     "unknown policy 'nope'"),
    (["serve", "--port", "0", "--config", "/does/not/exist.toml"], "does not exist"),
    (["decode", "--checkpoint", "/nowhere", "--kv-backend", "cuda-ipc"], "every stage and rank needs a cuda --device"),
])
def test_bad_configuration_is_a_clear_error(args, msg):
    r = subprocess.run([MESH_BIN, *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert msg in r.stderr and "Traceback" not in r.stderr


def test_config_validation():
    w = make_worker("prefill", {"url": "http://h:1", "id": "a"}, 0)
    with pytest.raises(ConfigError, match="duplicate worker id"):
        MeshConfig(prefill=(w, w))
    with pytest.raises(ConfigError, match="exclusive"):
        MeshConfig(prefill=(w,), workers=(make_worker("worker", {"url": "http://h:2"}, 0),))
    with pytest.raises(ConfigError, match="pp_size"):
        make_worker("prefill", {"url": "http://h:1", "pp_size": "two"}, 0)


async def test_regular_mode(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=0, decode=2), regular=True)
    for stream in (False, True):
        async with http.post(pd.url + "/v1/completions",
                             json={"model": "mock-model", "prompt": "plain", "max_tokens": 3, "stream": stream}) as r:
            assert r.status == 200
            raw = await r.read()
            assert (b"data: [DONE]" in raw) == stream
    async with http.get(pd.url + "/workers") as r:
        body = await r.json()
        assert body["mode"] == "regular" and {w["role"] for w in body["workers"]} == {"worker"}


async def test_ops_routes(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=2, decode=1))
    async with http.get(pd.url + "/health") as r:
        assert r.status == 200
    async with http.get(pd.url + "/ready") as r:
        assert r.status == 200 and (await r.json())["models"] == ["mock-model"]
    async with http.get(pd.url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["mock-model"]
    async with http.post(pd.url + "/v1/completions", json={"model": "mock-model", "prompt": "m", "max_tokens": 2,
                                                           "stream": True}) as r:
        await r.read()
    async with http.get(pd.url + "/metrics") as r:
        text = await r.text()
    for needle in ('atomesh_requests_total{route="completions",status="200"} 1.0',
                   'atomesh_request_duration_seconds_count{route="completions"} 1.0',
                   'atomesh_ttft_seconds_count{route="completions"} 1.0',
                   'atomesh_leg_duration_seconds_count{leg="prefill"} 1.0',
                   'atomesh_leg_duration_seconds_count{leg="decode"} 1.0',
                   'atomesh_worker_in_flight{role="prefill",worker="mock-prefill-1"} 0.0',
                   'atomesh_workers_healthy{role="prefill"} 2.0'):
        assert needle in text
    async with http.get(pd.url + "/workers") as r:
        ws = (await r.json())["workers"]
    assert {w["id"] for w in ws} == {"mock-prefill-0", "mock-prefill-1", "mock-decode-0"}
    assert all(w["healthy"] and w["load"]["in_flight"] == 0 for w in ws)


async def test_health_probe_marks_dead_worker_and_recovers(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=2, decode=1), health_interval=0.1, unhealthy_after=1)
    dead = pd.fleet.prefills[0]
    await pd.fleet._runners[0].cleanup()  # stop serving prefill 0's HTTP
    for _ in range(50):
        if not pd.state.fleet.healthy(dead.id):
            break
        await __import__("asyncio").sleep(0.05)
    assert not pd.state.fleet.healthy(dead.id)
    for i in range(5):
        async with http.post(pd.url + "/v1/completions", json={"model": "mock-model", "prompt": f"{i}"}) as r:
            assert r.status == 200


def test_mesh_bench_against_the_mesh(proc_pd, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([MESH_BIN, "bench", "--url", proc_pd["url"], "--model", "mock-model", "--requests", "20",
                        "--concurrency", "4", "--max-tokens", "6", "--out", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ttft ms" in r.stdout and "req/s" in r.stdout
    data = __import__("json").loads(out.read_text())
    assert data["ok"] == 20 and not data["errors"] and data["ttft_ms"]["p50"] > 0
    assert data["tokens_per_s"] > 0 and data["itl_ms"]["p50"] >= 0


def test_a_mesh_off_loopback_without_an_admin_token_is_told_and_ids_are_not_addresses():
    """issue 16: `mesh serve` warns when it listens beyond loopback with its admin routes open; a
    worker's default id (shown in /metrics, logs, registry keys) is stable but not its address."""
    from contract.clikit import loopback as _loopback
    from contract.clikit import opaque_worker_id as _opaque
    from workers.launch import opaque_id

    assert all(_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"))
    assert not any(_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.com"))
    a, b = opaque_id("prefill", "10.1.2.3", 8100), _opaque("decode", "http://10.1.2.3:8200")
    assert a == opaque_id("prefill", "10.1.2.3", 8100) and "10.1.2.3" not in a + b and "8100" not in a
    assert a.startswith("prefill-") and b.startswith("decode-") and a != opaque_id("prefill", "10.1.2.3", 8101)


def test_help_says_defaults_and_log_level_goes_anywhere():
    """issue 17: help showed no defaults; `--log-level` worked only before the subcommand."""
    import subprocess

    from tests.conftest import MESH_BIN

    out = subprocess.run([MESH_BIN, "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "(default: 8000)" in out and "(default: 127.0.0.1)" in out and "default: None" not in out
    r = subprocess.run([MESH_BIN, "workers", "--log-level", "ERROR", "--mesh", "http://127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("mesh: error:") and "Traceback" not in r.stderr
