"""`make run`'s listeners (issue 16): the demo (`mesh demo`: etcd, a PP=2 prefill, a TP=2 decode,
the mesh) binds every socket it listens on to the host it was given, here 127.0.0.1; none listens
on every interface. (The pinned Mooncake would: the demo moves KV with ZMQ by default, and the
spawned ranks' process groups use a FileStore: no listener at all.)"""

from __future__ import annotations

import signal
import socket
import subprocess
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
        # Ctrl-C: the demo stops its workers (they drain and withdraw), then etcd, and says little
        kids = procs[1:]
        demo.p.send_signal(signal.SIGINT)
        assert demo.p.wait(60) == 0
        err = demo.p.stderr.read() if demo.p.stderr else ""
        gone, alive = psutil.wait_procs(kids, timeout=20)
        assert not alive, [p.cmdline() for p in alive]
        lines = [x for x in err.splitlines() if x.strip()]
        print(f"\nstop: {len(lines)} stderr line(s):", *lines[-10:], sep="\n  ")
        assert len(lines) < 10 and "Traceback" not in err, err[-3000:]
        with socket.socket() as so:   # the port is free again
            so.bind(("127.0.0.1", port))
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("etcd-")]   # .run/ does not grow
    finally:
        demo.stop()


def test_a_second_demo_on_a_busy_port_says_so_and_starts_nothing(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([MESH_BIN, "demo", "--port", str(port), "--dir", str(tmp_path)], capture_output=True,
                           text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "--port" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not any(tmp_path.iterdir())   # nothing generated, nothing started


@pytest.mark.parametrize("args", [["workers", "--etcd", "http://127.0.0.1:{dead}"],
                                  ["workers", "--mesh", "http://127.0.0.1:{dead}"]])
def test_cli_failures_to_reach_etcd_or_the_mesh_are_one_line(args):
    dead = _free()
    r = subprocess.run([MESH_BIN, *[a.format(dead=dead) for a in args]], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("mesh: error:"), r.stderr
