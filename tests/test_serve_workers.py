"""`mesh serve --workers 2` (issue 20): two processes on one port, each its own mesh id, its own
ledger; neither adopts nor reclaims the other's transfers; /metrics from either counts both.

Real processes: `mesh mock-fleet` and `mesh serve --workers 2`. The decode drops every release,
so each transfer stays held on the prefill until the mesh that made it reclaims it as a lost
release; both processes see all transfers in the prefill's listing, and each must free only its
own (the holder lists every transfer with the mesh id that made it)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.conftest import MESH_BIN, Proc

N = 40


def per_process(url: str, path: str, want: int = 2, tries: int = 300) -> dict[str, Any]:
    """GET `path` over new connections until `want` processes (mesh ids) answered: id -> body."""
    got: dict[str, Any] = {}
    for _ in range(tries):
        with httpx.Client() as c:   # a new connection: the kernel picks the process
            body = c.get(url + path, timeout=10).json()
        got[body["mesh_id"]] = body
        if len(got) == want:
            return got
    raise AssertionError(f"only {sorted(got)} answered {path} in {tries} connections")


def test_two_processes_serve_with_their_own_ids_ledgers_and_shared_metrics() -> None:
    fleet = Proc([MESH_BIN, "mock-fleet", "--prefill", "1", "--decode", "1"], "ready")
    pre = next(x.split()[1] for x in fleet.lines if x.startswith("prefill "))
    dec = next(x.split()[1] for x in fleet.lines if x.startswith("decode "))
    mesh = None
    try:
        mesh = Proc([MESH_BIN, "serve", "--port", "0", "--workers", "2", "--mesh-id", "twin", "--ledger-grace", "1",
                     "--prefill", pre, "--decode", dec], "mesh ")
        url = mesh.lines[-1].split()[1]
        assert httpx.post(dec + "/mock/faults", json={"drop_release": 1.0}).status_code == 200
        ids = per_process(url, "/health")
        assert set(ids) == {"twin-0", "twin-1"}
        for i in range(N):
            with httpx.Client() as c:   # new connections: both processes serve
                r = c.post(url + "/v1/completions", headers={"X-Request-Id": f"req-{i}"},
                           json={"model": "mock-model", "prompt": f"prompt {i}", "max_tokens": 4}, timeout=30)
                assert r.status_code == 200, r.text
        # every transfer stays held (no release from the decode) until its own mesh reclaims it
        deadline = time.monotonic() + 30
        while httpx.get(pre + "/kv/held").json()["transfers"] and time.monotonic() < deadline:
            time.sleep(0.3)
        assert httpx.get(pre + "/kv/held").json()["transfers"] == []
        ledgers = per_process(url, "/kv/ledger")
        reqs = {mid: {r["request_id"] for r in lg["recent"]} for mid, lg in ledgers.items()}
        tids = {mid: {r["transfer_id"] for r in lg["recent"]} for mid, lg in ledgers.items()}
        assert reqs["twin-0"] and reqs["twin-1"], reqs                      # both served some
        assert not reqs["twin-0"] & reqs["twin-1"] and not tids["twin-0"] & tids["twin-1"]
        assert reqs["twin-0"] | reqs["twin-1"] == {f"req-{i}" for i in range(N)}
        for mid, lg in ledgers.items():   # each reclaimed its own lost releases, nothing of the other's
            assert lg["adopted_terminal"] == {} and lg["open"] == {}, lg
            assert lg["terminal"] == {"RECLAIMED": len(reqs[mid])}, lg["terminal"]
        # /metrics, from whichever process answers, counts the requests of both
        for _ in range(4):
            with httpx.Client() as c:
                text = c.get(url + "/metrics").text
            line = next(x for x in text.splitlines()
                        if x.startswith('atomesh_requests_total{route="completions",status="200"}'))
            assert float(line.split()[-1]) == N
    finally:
        if mesh is not None:
            assert mesh.stop() == 0
        fleet.stop()
