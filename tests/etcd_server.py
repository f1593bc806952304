"""A real etcd server for tests: 127.0.0.1, free ports, its own data dir, stopped by its pid."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Nobody listens there (TIME_WAIT leftovers of our own connections do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class EtcdServer:
    def __init__(self, data_dir: Path, tls: tuple[Path, Path, Path] | None = None) -> None:
        """`tls`: (CA, server certificate, server key): clients speak https (and the health check)."""
        if not os.path.exists(ETCD):
            raise RuntimeError("etcd is not installed: `make test` installs Debian's etcd-server")
        self.tls = tls
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"etcd-{self.client_port}.log"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20.0) -> None:
        # a leftover etcd on these ports would answer /health for us: refuse to start over it
        for p in (self.client_port, self.peer_port):
            if not port_is_free(p):
                raise RuntimeError(f"port {p} is taken; refusing to start etcd over it")
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [ETCD, "--name", "atomesh-test", "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"atomesh-test={peer}", "--log-level", "warn"]
        if self.tls:
            _ca, cert, key = self.tls
            # no --trusted-ca-file: with it etcd 3.4 asks clients for certificates (users log in with passwords)
            args += ["--cert-file", str(cert), "--key-file", str(key)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                verify: Any = ssl.create_default_context(cafile=str(self.tls[0])) if self.tls else True
                if httpx.get(self.url + "/health", timeout=0.5, verify=verify).json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("etcd did not become healthy")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
