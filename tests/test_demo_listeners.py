"""`make run`'s listeners (issue 16): the demo (`mesh demo`: etcd, a PP=2 prefill, a TP=2 decode,
the mesh) binds every socket it listens on to the host it was given, here 127.0.0.1; none listens
on every interface. (The pinned Mooncake would: the demo moves KV with ZMQ by default, and the
spawned ranks' process groups use a FileStore instead of torch's TCPStore, which binds `::`.)"""

from __future__ import annotations

import socket
import time

import httpx
import psutil
import pytest

from tests.conftest import MESH_BIN, Proc


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_every_listener_of_the_demo_is_bound_to_its_host(tmp_path):
    port = _free()
    demo = Proc([MESH_BIN, "demo", "--port", str(port), "--dir", str(tmp_path)], "Atomesh is up", timeout=180)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny-llama", "prompt": "Hello, mesh", "max_tokens": 4})
        assert r.status_code == 200, r.text
        time.sleep(0.5)
        procs = [psutil.Process(demo.p.pid), *psutil.Process(demo.p.pid).children(recursive=True)]
        listening = {}
        for p in procs:
            try:
                for c in p.net_connections(kind="inet"):
                    if c.status == psutil.CONN_LISTEN:
                        listening[(p.pid, " ".join(p.cmdline()[1:4]), c.laddr.port)] = c.laddr.ip
            except psutil.NoSuchProcess:
                continue
        assert len(procs) >= 7 and len(listening) >= 8, listening   # etcd, 2 workers, 2 ranks, the mesh...
        assert {ip for ip in listening.values()} == {"127.0.0.1"}, {k: v for k, v in listening.items()
                                                                    if v != "127.0.0.1"}
    finally:
        demo.stop()
