"""etcd with TLS and per-role users, as deploy/k8s runs it (issue 16 item 4): `mesh etcd-auth`
creates the roles and users and enables auth on a real etcd that speaks only TLS; a mock fleet
enrolls as the worker user, `mesh serve` reads the fleet as the mesh user and serves PD. Then the
attacks: the mesh's credentials cannot write a worker's key (no routing poisoning by whoever holds
them), the workers' cannot write a mesh record, no credentials read nothing, plaintext gets no
answer."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import aetcd
import httpx
import pytest

from contract.etcd import EtcdConfig, open_client
from tests.conftest import MESH_BIN, Proc
from tests.etcd_server import EtcdServer

PASSWORDS = {"ATOMESH_ETCD_ROOT_PASSWORD": "root-password-for-tests",
             "ATOMESH_ETCD_MESH_PASSWORD": "mesh-password-for-tests",
             "ATOMESH_ETCD_WORKER_PASSWORD": "worker-password-for-tests"}


def _certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1, made with openssl (a Debian package `make test` installs)."""
    ca_key, ca, key, csr, cert, ext = (d / n for n in ("ca.key", "ca.crt", "server.key", "server.csr",
                                                        "server.crt", "san.cnf"))
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
        "-subj", "/CN=atomesh-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(cert),
        "-days", "2", "-extfile", str(ext))
    return ca, cert, key


@pytest.fixture
def tls_etcd(tmp_path):
    ca, cert, key = _certs(tmp_path)
    server = EtcdServer(tmp_path / "etcd-data", tls=(ca, cert, key))
    server.start()
    yield server, ca
    server.stop()


async def _put(cfg: EtcdConfig, key: bytes) -> str:
    """Try to write `key` as `cfg`'s user: 'ok' or what etcd said."""
    c = open_client(cfg)
    try:
        await c.put(key, b'{"id": "evil", "model": "m", "url": "http://127.0.0.1:9"}')
        return "ok"
    except aetcd.ClientError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        await c.close()


@pytest.mark.timeout(180)
async def test_per_role_users_over_tls_serve_pd_and_refuse_each_others_keys(tls_etcd):
    server, ca = tls_etcd
    common = ["--etcd", server.url, "--etcd-ca", str(ca), "--cluster", "c1"]
    env = {**os.environ, **PASSWORDS}
    for run in range(2):   # twice: the second run (auth already on) logs in as root and changes nothing
        r = await asyncio.to_thread(subprocess.run, [MESH_BIN, "etcd-auth", *common], capture_output=True,
                                    text=True, timeout=60, env=env)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        if run == 0:
            assert "auth enabled" in r.stdout and "user atomesh-mesh" in r.stdout, r.stdout
        else:
            assert r.stdout.startswith("nothing to do"), r.stdout
    procs: list[Proc] = []
    try:
        fleet = await asyncio.to_thread(Proc, [MESH_BIN, "mock-fleet", *common, "--etcd-user", "atomesh-worker"],
                                        "ready", {"ATOMESH_ETCD_PASSWORD": PASSWORDS["ATOMESH_ETCD_WORKER_PASSWORD"]},
                                        60)
        procs.append(fleet)
        mesh = await asyncio.to_thread(Proc, [MESH_BIN, "serve", "--port", "0", *common, "--etcd-user", "atomesh-mesh"],
                                       "mesh ", {"ATOMESH_ETCD_PASSWORD": PASSWORDS["ATOMESH_ETCD_MESH_PASSWORD"]}, 60)
        procs.append(mesh)
        url = mesh.lines[-1].split()[1]
        async with httpx.AsyncClient(timeout=30) as http:
            deadline = time.monotonic() + 30
            while (await http.get(url + "/ready")).status_code != 200:
                assert time.monotonic() < deadline, (await http.get(url + "/ready")).text
                await asyncio.sleep(0.2)
            r = await http.post(url + "/v1/completions", json={"model": "mock-model", "prompt": "over tls",
                                                              "max_tokens": 4})
            assert r.status_code == 200 and r.json()["choices"][0]["text"].count(" t") == 4, r.text
            assert (await http.get(url + "/ready")).json()["registry_stale"] is False
        base = EtcdConfig.from_url(server.url, cluster="c1", ca_file=str(ca))
        keys = base.keys
        as_mesh = EtcdConfig.from_url(server.url, cluster="c1", ca_file=str(ca), username="atomesh-mesh",
                                      password=PASSWORDS["ATOMESH_ETCD_MESH_PASSWORD"])
        as_worker = EtcdConfig.from_url(server.url, cluster="c1", ca_file=str(ca), username="atomesh-worker",
                                        password=PASSWORDS["ATOMESH_ETCD_WORKER_PASSWORD"])
        # the mesh's credentials: its own record yes, a worker's key no (no routing poisoning)
        assert await _put(as_mesh, keys.mesh("m-test")) == "ok"
        for k in (keys.decode("evil"), keys.prefill("evil"), keys.stage("evil", 1)):
            assert "ermission" in await _put(as_mesh, k)
        # the workers' credentials: worker keys yes, a mesh record or another cluster no
        assert "ermission" in await _put(as_worker, keys.mesh("evil"))
        assert "ermission" in await _put(as_worker, b"/atomesh/v1/other/decode/evil")
        # no credentials: nothing read or written
        c = open_client(base)
        try:
            with pytest.raises(aetcd.ClientError):
                await c.get(keys.decode("x"))
        finally:
            await c.close()
        # plaintext to the TLS port: no answer
        plain = EtcdConfig.from_url(server.url.replace("https://", "http://"), cluster="c1", timeout=2)
        c = open_client(plain)
        try:
            with pytest.raises((aetcd.ClientError, OSError, asyncio.TimeoutError)):
                await c.get(keys.decode("x"))
        finally:
            await c.close()
        # the fleet is served as before: nothing above poisoned the mesh's view
        async with httpx.AsyncClient(timeout=30) as http:
            workers = (await http.get(url + "/workers")).json()
            ids = sorted(w["id"] for w in workers["workers"])
            assert ids == ["mock-decode-0", "mock-prefill-0"], workers
    finally:
        for p in procs[::-1]:
            p.stop()
