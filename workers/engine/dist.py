"""Rank 0's side of a multi-process engine: ranks 1..n-1 spawned here, or remote stages that join.

Each spawned rank is a named process that builds its slice of the model (`workers.engine.rank`),
acks when ready, then runs the commands rank 0 names, over a ZMQ PAIR socket in typed msgpack
frames (`workers.engine.ctrl`, no pickle), after both ends proved the pipeline's secret (random
per engine for spawned ranks; the `ATOMESH_PIPELINE_SECRET` of the head and its remote stages).
Tensors between ranks (PP hidden states, logits back to rank 0, TP all-reduce) go over a process
group of the engine's own (`workers.engine.group`), so several engines can live in one process
without a global default group. A rank that dies is reported (`RankDied`) rather than waited on
forever.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.monitor as zmq_monitor

from contract.errors import ProtocolError
from workers.engine import ctrl
from workers.engine.config import EngineConfig, Parallel
from workers.engine.group import Wire, free_port, group_backend, make_group
from workers.engine.rank import RankDied, RankSpec, RankStartup, heartbeats, rank_main

log = logging.getLogger(__name__)

__all__ = ["RankDied", "RankSpec", "Ranks"]


class Ranks:
    """Rank 0's side: ranks 1..world-1 (spawned here, or remote stages that connect), rank 0's
    group, and a control socket per rank.

    `remote_port` set: nothing is spawned; stage r (`mesh stage --head HOST:PORT --pp-rank r`)
    connects to this host's `remote_port + r`, gets its spec, and the gloo store listens on
    `remote_port` (bound on `bind_host`)."""

    def __init__(self, kind: str, checkpoint: str | Path, engine: EngineConfig, pars: list[Parallel],
                 start_timeout: float = 120.0, kv_backend: str | None = None, kv_host: str = "127.0.0.1",
                 remote_port: int | None = None, bind_host: str = "127.0.0.1",
                 devices: list[str] | None = None, producer: bool = False, cancel: Any = None,
                 startup: RankStartup | None = None) -> None:
        """`cancel` (a threading.Event): set, the wait for remote stages ends (SIGTERM during it).
        `startup`: what each spawned rank runs once built (the KV side, given `kv_backend`; a
        remote stage gets its own from `mesh stage`)."""
        if kv_backend and startup is None and remote_port is None:
            raise ValueError("kv_backend needs a rank start-up hook (workers.rank_hooks.startup)")
        self.startup = startup
        self._store_sock: socket.socket | None = None
        self.cancel = cancel
        self.kind = kind
        self.world = len(pars)
        devices = devices or [engine.device] * self.world
        if len(devices) != self.world or devices[0] != engine.device:
            raise ValueError(f"give one device per rank ({self.world}), the first being rank 0's ({engine.device})")
        self.backend = group_backend(devices)
        self.wire = Wire(self.backend, engine.device)
        self.remote = remote_port is not None
        self._zctx = zmq.Context()
        self.socks: list[zmq.Socket] = []
        self.monitors: list[zmq.Socket] = []
        self.procs: list[Any] = []
        self.infos: dict[int, dict[str, Any]] = {}
        self._ready: Any = None
        self._lost: set[int] = set()
        self._peer_fd: dict[int, int] = {}   # a remote stage's connection, once it proved the secret
        self.bind_host = bind_host
        secret = ctrl.pipeline_secret(required=True) if self.remote else os.urandom(32)
        assert secret is not None
        self.secret = secret
        specs = []
        store_port = remote_port if remote_port is not None else free_port()
        self._store_dir = None if self.remote else tempfile.mkdtemp(prefix="atomesh-store-")  # mode 0700
        store_path = os.path.join(self._store_dir, "store") if self._store_dir else ""
        for r in range(1, self.world):
            if self.remote:
                s, mon = self._bind_remote(store_port + r)
                self.monitors.append(mon)
                port = store_port + r
            else:
                s = self._zctx.socket(zmq.PAIR)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDTIMEO, 500)
                port = s.bind_to_random_port("tcp://127.0.0.1")
            self.socks.append(s)
            specs.append(RankSpec(kind, str(checkpoint), dataclasses.replace(engine, device=devices[r]), pars[r], r,
                                  self.world, store_port, port, kv_backend, kv_host, backend=self.backend,
                                  producer=producer, secret=secret, store_path=store_path))
        try:
            if self.remote:
                self._join_remote(specs, start_timeout, bind_host)
            else:
                self._spawn(specs, start_timeout)
        except BaseException:
            self.close()
            raise

    def _bind_remote(self, port: int) -> tuple[zmq.Socket, zmq.Socket]:
        s = self._zctx.socket(zmq.PAIR)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 500)
        heartbeats(s)
        mon = s.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        for attempt in range(50):  # bound anew after dropping a peer: the old socket frees the port async
            try:
                s.bind(f"tcp://{self.bind_host}:{port}")
                break
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or attempt == 49:
                    raise
                time.sleep(0.1)
        return s, mon

    def _accept(self, r: int, deadline: float, then: bytes) -> None:
        """The head's side of the handshake on rank r's socket, until a peer proves the secret or
        `deadline`; a peer that fails is dropped (the socket bound anew) and the next one awaited."""
        while True:
            s = self.socks[r - 1]
            left = deadline - time.monotonic()
            try:
                while left > 0 and not s.poll(int(min(left, 1.0) * 1000)):  # 1 s slices: a stop is heard
                    if self.cancel is not None and self.cancel.is_set():
                        raise RankDied("stopped while waiting for the stages")
                    left = deadline - time.monotonic()
                if left <= 0:
                    raise RankDied(f"no rank {r} proved the pipeline secret within the start timeout"
                                   + (f" (start it with mesh stage --pp-rank {r})" if self.remote else ""))
                _, (rank, n_s) = ctrl.unpack(s.recv(), ("hello",))
                if rank != r:
                    raise ProtocolError(f"port for rank {r} got a hello from rank {rank}")
                n_h = ctrl.nonce()
                s.send(ctrl.pack("challenge", n_h, ctrl.mac(self.secret, b"head", r, n_s)))
                if not s.poll(int(max(0.1, min(10.0, deadline - time.monotonic())) * 1000)):
                    raise ProtocolError("no answer to the challenge")
                _, (proof,) = ctrl.unpack(s.recv(), ("auth",))
                if not ctrl.check_mac(self.secret, b"stage", r, n_h, proof):
                    raise ProtocolError("the proof of the pipeline secret is wrong")
            except ProtocolError as e:
                log.warning("rank %d control port: a peer failed the handshake (%s): dropped", r, e.message)
                if not self.remote:
                    raise RankDied(f"rank {r} failed the control handshake: {e.message}") from None
                port = int(bytes(s.getsockopt(zmq.LAST_ENDPOINT)).decode().rsplit(":", 1)[1])
                s.disable_monitor()
                self.monitors[r - 1].close(0)
                s.close(0)
                self.socks[r - 1], self.monitors[r - 1] = self._bind_remote(port)
                continue
            s.send(then)
            if self.remote:
                self._peer_fd[r] = self._accepted_fd(r)
            return

    def _accepted_fd(self, r: int) -> int:
        """The connection a remote stage proved itself on: the newest accepted one still open."""
        open_fds: list[int] = []
        mon = self.monitors[r - 1]
        while mon.poll(0):
            ev = zmq_monitor.recv_monitor_message(mon)
            if ev["event"] == zmq.EVENT_ACCEPTED:
                open_fds.append(ev["value"])
            elif ev["event"] == zmq.EVENT_DISCONNECTED and ev["value"] in open_fds:
                open_fds.remove(ev["value"])
        return open_fds[-1] if open_fds else -1

    def _spawn(self, specs: list[RankSpec], start_timeout: float) -> None:
        mpctx = mp.get_context("spawn")
        self._ready = mpctx.Queue()
        for spec in specs:
            p = mpctx.Process(target=rank_main, args=(spec, self._ready, self.startup),
                              name=f"atomesh-{self.kind}-rank{spec.rank}", daemon=True)
            p.start()
            self.procs.append(p)
        deadline = time.monotonic() + start_timeout
        for spec in specs:
            self._accept(spec.rank, deadline, ctrl.pack("ok"))
        self.group = make_group(0, self.world, specs[0].store_port, backend=self.backend,
                                device=self.wire.device, store_path=specs[0].store_path)[0] if specs else None
        for _ in specs:
            try:
                status, *info = self._ready.get(timeout=start_timeout)
            except Exception:  # noqa: BLE001 - queue.Empty
                raise RankDied(f"a {self.kind} rank did not start within {start_timeout}s") from None
            if status != "ready":
                raise RankDied(f"a {self.kind} rank failed to start:\n{info[0]}")
            self.infos[info[0]] = info[1]

    def _join_remote(self, specs: list[RankSpec], start_timeout: float, bind_host: str) -> None:
        deadline = time.monotonic() + start_timeout
        for spec in specs:
            self._accept(spec.rank, deadline, ctrl.pack("spec", ctrl.spec_out(spec)))
        # the store serves on its listening socket for the group's life
        self.group, self._store_sock = make_group(0, self.world, specs[0].store_port, bind_host, self.backend,
                                                  self.wire.device)
        for s, spec in zip(self.socks, specs):
            if not s.poll(int(start_timeout * 1000)):
                raise RankDied(f"stage {spec.rank} did not get ready within {start_timeout:g}s")
            try:
                status, info = ctrl.unpack(s.recv(), ("ready", "error"))
            except ProtocolError as e:
                raise RankDied(f"stage {spec.rank}: {e.message}") from None
            if status != "ready":
                raise RankDied(f"stage {spec.rank} failed to start:\n{info[0]}")
            self.infos[info[0]] = info[1]

    def dead(self) -> str | None:
        """What died, if a rank did: a spawned process that exited, or a remote stage whose
        connection dropped."""
        for p in self.procs:
            if not p.is_alive():
                return f"{p.name} died with exit code {p.exitcode}"
        for r, mon in enumerate(self.monitors, start=1):
            while mon.poll(0):  # only the proven stage's connection counts, not any peer's connect
                ev = zmq_monitor.recv_monitor_message(mon)
                if ev["event"] == zmq.EVENT_DISCONNECTED and ev["value"] == self._peer_fd.get(r):
                    self._lost.add(r)
        return f"remote stage {min(self._lost)} disconnected" if self._lost else None

    def check(self) -> None:
        why = self.dead()
        if why:
            raise RankDied(why)

    def _send(self, s: zmq.Socket, data: bytes) -> None:
        """A PAIR socket blocks a send while its peer is gone: wait in slices, checking the ranks."""
        while True:
            self.check()
            try:
                s.send(data)
                return
            except zmq.Again:
                continue

    @staticmethod
    def _frame(msg: tuple[Any, ...]) -> bytes:
        """A command as a typed frame: batches and configs as their declared maps and lists."""
        cmd, *args = msg
        if cmd == "forward":
            return ctrl.pack("forward", ctrl.batch_out(args[0]), args[1])
        if cmd == "enroll":  # no credentials: the stage reads its own from its environment
            etcd, pipeline_id, stage, ttl = args
            cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(etcd).items()
                   if k not in ("username", "password")}
            return ctrl.pack("enroll", cfg, pipeline_id, stage.encode(), ttl)
        return ctrl.pack(cmd, *args)

    def send(self, rank: int, *msg: Any) -> None:
        self._send(self.socks[rank - 1], self._frame(msg))

    def broadcast(self, *msg: Any) -> None:
        data = self._frame(msg)
        for s in self.socks:
            self._send(s, data)

    def request(self, rank: int, *msg: Any, timeout_ms: int = 60000) -> Any:
        """A command that answers: a tensor, "pong", "ok", or "error: ..."."""
        self.send(rank, *msg)
        s = self.socks[rank - 1]
        if not s.poll(timeout_ms):
            self.check()
            raise RankDied(f"rank {rank} did not answer {msg[0]!r}")
        try:
            cmd, args = ctrl.unpack(s.recv(), ("tensor", "pong", "ok", "error"))
        except ProtocolError as e:
            raise RankDied(f"rank {rank}: {e.message}") from None
        if cmd == "tensor":
            return args[0]
        return f"error: {args[0]}" if cmd == "error" else cmd

    def close(self) -> None:
        for s in self.socks:
            try:
                s.send(ctrl.pack("stop"), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for s, m in zip(self.socks, self.monitors):
            s.disable_monitor()
            m.close(0)
        for s in self.socks:
            s.close(0)
        self.socks.clear()
        self.monitors.clear()
        self._zctx.term()
        if self._ready is not None:
            self._ready.close()
            self._ready.join_thread()
        if self._store_sock is not None:
            self._store_sock.close()
            self._store_sock = None
        store_dir = getattr(self, "_store_dir", None)
        if store_dir:
            shutil.rmtree(store_dir, ignore_errors=True)
            self._store_dir = None
