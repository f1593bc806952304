"""Multi-process engines: rank 0 in the caller's process, ranks 1..n-1 spawned.

Each spawned rank is a named process that builds its slice of the model (its PP layers or its
TP shard), acks when ready, then serves commands from rank 0 over a ZMQ PAIR socket (batch
metadata, KV reads and writes, stop) in typed msgpack frames (`workers.engine.ctrl`, no pickle),
after both ends proved the pipeline's secret (random per engine for spawned ranks; the
`ATOMESH_PIPELINE_SECRET` of the head and its remote stages). Tensors between ranks (PP hidden states, logits back
to rank 0, TP all-reduce) go over a gloo process group of its own (`ProcessGroupGloo` on a
`TCPStore`), so several engines can live in one process without a global default group.
A rank that dies is reported (`RankDied`) rather than waited on forever.

Size: the rank side and the rank-0 side (`Ranks`) of one control protocol, with its handshake
and process-group setup; issue 18 item 2 splits it (ranks run rank 0's methods by name).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import zmq
import zmq.utils.monitor as zmq_monitor

from contract.errors import ProtocolError
from workers.engine import ctrl
from workers.engine.checkpoint import load_weights
from workers.engine.config import EngineConfig, ModelConfig, Parallel
from workers.engine.kv_cache import KVPool
from workers.engine.model import LlamaStage

log = logging.getLogger(__name__)
TIMEOUT = datetime.timedelta(seconds=60)


class RankDied(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_backend(devices: list[str]) -> str:
    """`nccl` when every rank holds a GPU of its own (cuda:N, all different); else `gloo`, with
    device tensors going through host memory (ranks sharing one GPU, or CPU ranks)."""
    if len(devices) > 1 and all(d.startswith("cuda:") for d in devices) and len(set(devices)) == len(devices):
        return "nccl"
    return "gloo"


class Wire:
    """How one rank's tensors travel to the others: as they are (NCCL, on the GPU) or through
    host memory (gloo)."""

    def __init__(self, backend: str, device: str) -> None:
        self.direct = backend == "nccl"
        self.device = device

    def out(self, t: torch.Tensor) -> torch.Tensor:
        return t.contiguous() if self.direct else t.contiguous().cpu()

    def buffer(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=self.device if self.direct else "cpu")

    def into(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)


_STORE_SOCKETS: list[socket.socket] = []


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port only (for a TCPStore's server: `master_listen_fd`)."""
    fam = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host.strip("[]"), port))
        s.listen(512)
    except OSError:
        s.close()
        raise
    return s


def make_group(rank: int, world: int, port: int, host: str = "127.0.0.1", backend: str = "gloo",
               device: str = "cpu", store_path: str = "") -> Any:
    """A process group on a store: a FileStore at `store_path` for ranks spawned on this host (no
    listener at all), else a TCPStore at host:port (rank 0 serves it on a socket bound to `host`
    only: remote stages). NCCL when the ranks hold distinct GPUs
    (NVLink multicast off: NCCL_NVLS_ENABLE=0 unless set); gloo otherwise, binding the address the
    host name resolves to, or the interface named by GLOO_SOCKET_IFNAME."""
    # torch's stubs do not list its c10d store and gloo option classes among torch.distributed's
    # exports (they are re-exported from the C extension at import): the attributes exist at run time
    store: Any
    if store_path:
        # (type: ignore below) torch's stubs omit the c10d stores (see above)
        store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
    elif rank == 0:   # the store's server on a socket of our own, bound to `host` (torch's binds every interface)
        lsock = bound_listener(host, port)
        # (type: ignore below) torch's stubs omit the c10d stores (see above)
        store = dist.TCPStore(host, port, world, is_master=True, timeout=TIMEOUT,  # type: ignore[attr-defined]
                              master_listen_fd=lsock.fileno())
        _STORE_SOCKETS.append(lsock)   # the store serves on its fd for the process's life
    else:
        # (type: ignore below) torch's stubs omit the c10d stores (see above)
        store = dist.TCPStore(host, port, world, is_master=False, timeout=TIMEOUT)  # type: ignore[attr-defined]
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (see make_group's store)
        opts._timeout = TIMEOUT
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=ifname)]
        return dist.ProcessGroupGloo(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, TIMEOUT)


def all_reduce_fn(group: Any, direct: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """Sum over the TP ranks: in place with NCCL (`direct`) or for host tensors; device tensors
    under gloo go through host memory (ranks may share one GPU, where NCCL needs distinct devices)."""
    def reduce(t: torch.Tensor) -> torch.Tensor:
        if direct or t.device.type == "cpu":
            t = t.contiguous()
            group.allreduce([t]).wait()
            return t
        h = t.cpu()
        group.allreduce([h]).wait()
        return h.to(t.device)
    return reduce


@dataclass(frozen=True, slots=True)
class RankSpec:
    kind: str               # "tp" | "pp"
    checkpoint: str
    engine: EngineConfig
    par: Parallel
    rank: int
    world: int
    store_port: int
    ctrl_port: int
    kv_backend: str | None = None     # set: register the pools, serve KV (pp stages) and report how
    kv_host: str = "127.0.0.1"
    head: str = "127.0.0.1"           # where rank 0's store and control sockets listen
    backend: str = "gloo"             # the group's backend (group_backend of every rank's device)
    producer: bool = False            # a TP prefill rank: serves its KV heads over the side channel
    secret: bytes = b""               # the control channel's shared secret (never sent on it)
    store_path: str = ""              # spawned ranks: the group's FileStore (never from the network)


def _rank_main(spec: RankSpec, ready: Any) -> None:
    """A spawned rank: connect to rank 0, then build, ack and serve."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{spec.ctrl_port}")
    try:
        _stage_handshake(sock, spec.rank, spec.secret, 120.0, ("ok",))
        _serve_rank(spec, sock, ready.put)
    except (RankDied, ProtocolError) as e:
        ready.put(("error", str(e)))
    finally:
        sock.close(0)
        ctx.term()


def _stage_handshake(sock: zmq.Socket, rank: int, secret: bytes, timeout: float,
                     then: tuple[str, ...]) -> list[Any]:
    """A rank's side: hello with a nonce, check the head's proof, prove ours; the head's next frame
    (`then`: the spec for a remote stage, ok for a spawned rank) is returned."""
    n_s = ctrl.nonce()
    sock.send(ctrl.pack("hello", rank, n_s))

    def recv(expect: tuple[str, ...]) -> list[Any]:
        if not sock.poll(int(timeout * 1000)):
            raise RankDied(f"no pipeline head answered within {timeout:g}s")
        return ctrl.unpack(sock.recv(), expect)[1]

    n_h, proof = recv(("challenge",))
    if not ctrl.check_mac(secret, b"head", rank, n_s, proof):
        raise RankDied("the pipeline head did not prove the pipeline secret: not joining it")
    sock.send(ctrl.pack("auth", ctrl.mac(secret, b"stage", rank, n_h)))
    return recv(then)


def serve_remote_stage(head: str, port: int, pp_rank: int, checkpoint: str, kv_host: str,
                       connect_timeout: float = 600.0) -> None:
    """`mesh stage`: one PP stage in its own process (its own pod), joining the pipeline whose
    head (`mesh prefill --remote-stages PORT`) listens at head:port. The head sends the spec; the
    stage builds its layers, joins the gloo group, acks, and serves until `stop` or until the
    head is gone (then it exits, to be restarted and join the next head)."""
    secret = ctrl.pipeline_secret(required=True)
    assert secret is not None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    _heartbeats(sock)
    sock.connect(f"tcp://{head}:{port + pp_rank}")
    try:
        try:
            (raw,) = _stage_handshake(sock, pp_rank, secret, connect_timeout, ("spec",))
            spec = ctrl.spec_in(raw, RankSpec)
        except ProtocolError as e:
            raise RankDied(f"the head at {head}:{port + pp_rank}: {e.message}") from None
        spec = dataclasses.replace(spec, checkpoint=checkpoint, kv_host=kv_host, head=head, secret=secret)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            _serve_rank(spec, sock, lambda msg: sock.send(ctrl.pack(*msg)), monitor)
        finally:
            sock.disable_monitor()
            monitor.close(0)
    finally:
        sock.close(0)
        ctx.term()


def _heartbeats(s: zmq.Socket) -> None:
    """ZMTP heartbeats: a peer on another host that vanished without a reset is noticed."""
    s.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    s.setsockopt(zmq.HEARTBEAT_TTL, 6000)


def _disconnected(monitor: zmq.Socket | None) -> bool:
    while monitor is not None and monitor.poll(0):
        if zmq_monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            return True
    return False


def _withdraw(enrollment: Any, kv_loop: Any) -> None:
    """Deregister this stage's liveness key (its lease would expire anyway)."""
    if enrollment is not None and kv_loop is not None:
        try:
            asyncio.run_coroutine_threadsafe(enrollment.close(), kv_loop).result(10)
        except Exception:  # noqa: BLE001 - its lease expires anyway
            pass


def _serve_rank(spec: RankSpec, sock: zmq.Socket, ack: Callable[[Any], None],
                monitor: zmq.Socket | None = None) -> None:
    """Build this rank's slice, ack ("ready", rank, info) or ("error", traceback), serve commands."""
    try:
        torch.set_num_threads(1)
        mc = ModelConfig.load(spec.checkpoint)
        dev = spec.engine.device
        group = make_group(spec.rank, spec.world, spec.store_port, spec.head, spec.backend, dev, spec.store_path)
        wire = Wire(spec.backend, dev)
        weights = load_weights(spec.checkpoint, mc, spec.par, spec.engine.torch_dtype, dev)
        model = LlamaStage(mc, spec.par, weights, all_reduce_fn(group, wire.direct) if spec.kind == "tp" else None)
        pool = KVPool(len(model.layer_ids), spec.engine.num_blocks, model.kv_heads, spec.engine.block_size,
                      mc.head_dim, spec.engine.torch_dtype, dev)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails clearly
        ack(("error", traceback.format_exc()))
        return
    info: dict[str, Any] = {}
    kv_loop = None
    enrollment = None
    if spec.kv_backend:
        try:
            from workers.kv.stage import register_pool, start_stage_thread

            ep = register_pool(pool, spec.kv_backend, spec.kv_host)
            info = {"segment": ep.transport.segment, "regions": ep.regions}
            if spec.kind == "pp":
                info["kv_port"], kv_loop = start_stage_thread(ep, spec.kv_host, spec.par.pp_rank,
                                                              spec.par.layer_start, spec.par.layer_end,
                                                              grant_key=spec.secret)
            elif spec.producer:  # TP prefill rank r: every layer, its slice of the KV heads
                info["kv_port"], kv_loop = start_stage_thread(ep, spec.kv_host, spec.rank, 0, mc.num_hidden_layers,
                                                              head0=spec.rank * model.kv_heads,
                                                              grant_key=spec.secret)
        except Exception:  # noqa: BLE001 - reported to the parent
            ack(("error", traceback.format_exc()))
            return
    ack(("ready", spec.rank, info))
    dtype = spec.engine.torch_dtype
    while True:
        if monitor is not None and not sock.poll(1000):
            if _disconnected(monitor):
                _withdraw(enrollment, kv_loop)
                raise RankDied(f"stage {spec.rank}: the pipeline head at {spec.head} is gone")
            continue
        try:
            cmd, args = ctrl.unpack(sock.recv())
        except ProtocolError as e:  # the peer proved the secret: a bug, not an attack; say so, go on
            log.error("rank %d: bad control frame: %s", spec.rank, e.message)
            continue
        if cmd == "stop":
            _withdraw(enrollment, kv_loop)
            break
        if cmd == "enroll":  # this stage's own liveness key, under its own lease, kept by this process
            try:
                if kv_loop is None:
                    raise RuntimeError("enroll needs a stage with a KV side channel")
                from contract.etcd import EtcdConfig
                from contract.protocol import StageRecord
                from workers.register import EnrollConfig, Enrollment

                etcd_map, pipeline_id, stage_map, ttl = args
                # this stage's own credentials, from its own environment: none travel on this channel
                etcd_cfg = EtcdConfig(**{**etcd_map, "endpoints": tuple(etcd_map.get("endpoints") or ()),
                                         "username": os.environ.get("ATOMESH_ETCD_USER"),   # as --etcd-user
                                         "password": os.environ.get("ATOMESH_ETCD_PASSWORD")})
                enrollment = Enrollment(etcd=etcd_cfg, record=None, stages=(StageRecord.decode(stage_map, "stage"),),
                                        pipeline_id=pipeline_id, cfg=EnrollConfig(ttl=ttl))
                asyncio.run_coroutine_threadsafe(enrollment.start(), kv_loop).result(60)
                sock.send(ctrl.pack("ok"))
            except Exception as e:  # noqa: BLE001 - told to rank 0, which fails its start clearly
                sock.send(ctrl.pack("error", str(e)))
            continue
        if cmd == "forward":  # tensors cross processes in host memory; compute on this rank's device
            raw_batch, ids = args
            batch = ctrl.batch_in(raw_batch).to(dev)
            if spec.kind == "tp":
                model.forward(batch, pool, input_ids=ids.to(dev))
            else:  # pp: hidden from the previous stage, to the next (or logits to stage 0)
                hidden = wire.buffer(len(batch.positions), mc.hidden_size, dtype=dtype)
                group.recv([hidden], spec.rank - 1, 0).wait()
                out = wire.out(model.forward(batch, pool, hidden=wire.into(hidden)))
                group.send([out], (spec.rank + 1) % spec.world, 0).wait()
        elif cmd == "write_kv":  # (local layer, block ids, kv [n, 2, kvh, bs, hd])
            layer, blocks, kv = args
            if _kv_args_ok(pool, layer, blocks, spec.rank):
                pool.layers[layer][torch.tensor(blocks, device=dev)] = kv.to(device=dev, dtype=dtype)
        elif cmd == "read_kv":
            layer, blocks = args
            if _kv_args_ok(pool, layer, blocks, spec.rank):
                sock.send(ctrl.pack("tensor", pool.layers[layer][torch.tensor(blocks, device=dev)].cpu()))
            else:
                sock.send(ctrl.pack("error", "bad layer or block ids"))
        elif cmd == "ping":
            sock.send(ctrl.pack("pong"))


def _kv_args_ok(pool: KVPool, layer: int, blocks: list[int], rank: int) -> bool:
    if 0 <= layer < len(pool.layers) and all(0 <= b < pool.layers[layer].shape[0] for b in blocks):
        return True
    log.error("rank %d: KV command for layer %d, blocks out of the pool: refused", rank, layer)
    return False


class Ranks:
    """Rank 0's side: ranks 1..world-1 (spawned here, or remote stages that connect), rank 0's
    group, and a control socket per rank.

    `remote_port` set: nothing is spawned; stage r (`mesh stage --head HOST:PORT --pp-rank r`)
    connects to this host's `remote_port + r`, gets its spec, and the gloo store listens on
    `remote_port` (bound on `bind_host`)."""

    def __init__(self, kind: str, checkpoint: str | Path, engine: EngineConfig, pars: list[Parallel],
                 start_timeout: float = 120.0, kv_backend: str | None = None, kv_host: str = "127.0.0.1",
                 remote_port: int | None = None, bind_host: str = "127.0.0.1",
                 devices: list[str] | None = None, producer: bool = False, cancel: Any = None) -> None:
        """`cancel` (a threading.Event): set, the wait for remote stages ends (SIGTERM during it)."""
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
        _heartbeats(s)
        mon = s.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        for attempt in range(50):  # bound anew after dropping a peer: the old socket frees the port async
            try:
                s.bind(f"tcp://{self.bind_host}:{port}")
                break
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or attempt == 49:
                    raise
                import time
                time.sleep(0.1)
        return s, mon

    def _accept(self, r: int, deadline: float, then: bytes) -> None:
        """The head's side of the handshake on rank r's socket, until a peer proves the secret or
        `deadline`; a peer that fails is dropped (the socket bound anew) and the next one awaited."""
        import time

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
        import time

        mpctx = mp.get_context("spawn")
        self._ready = mpctx.Queue()
        for spec in specs:
            p = mpctx.Process(target=_rank_main, args=(spec, self._ready), name=f"atomesh-{self.kind}-rank{spec.rank}",
                              daemon=True)
            p.start()
            self.procs.append(p)
        deadline = time.monotonic() + start_timeout
        for spec in specs:
            self._accept(spec.rank, deadline, ctrl.pack("ok"))
        self.group = make_group(0, self.world, specs[0].store_port, backend=self.backend,
                                device=self.wire.device, store_path=specs[0].store_path) if specs else None
        for _ in specs:
            try:
                status, *info = self._ready.get(timeout=start_timeout)
            except Exception:  # noqa: BLE001 - queue.Empty
                raise RankDied(f"a {self.kind} rank did not start within {start_timeout}s") from None
            if status != "ready":
                raise RankDied(f"a {self.kind} rank failed to start:\n{info[0]}")
            self.infos[info[0]] = info[1]

    def _join_remote(self, specs: list[RankSpec], start_timeout: float, bind_host: str) -> None:
        import time

        deadline = time.monotonic() + start_timeout
        for spec in specs:
            self._accept(spec.rank, deadline, ctrl.pack("spec", ctrl.spec_out(spec)))
        self.group = make_group(0, self.world, specs[0].store_port, bind_host, self.backend, self.wire.device)
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
        store_dir = getattr(self, "_store_dir", None)
        if store_dir:
            shutil.rmtree(store_dir, ignore_errors=True)
            self._store_dir = None
