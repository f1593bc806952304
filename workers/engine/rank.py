"""The rank side of a multi-process engine: a spawned rank (TP shard, PP stage) or a remote stage
(`mesh stage`), as nano-vllm's ModelRunner does it: rank 0 names a method of `Rank`, the rank runs
it. The names are an explicit allow-list (`Rank.COMMANDS`, plus what a start-up hook adds); each
command's frame has one declared shape (`workers.engine.ctrl`: typed msgpack, no pickle), checked
before the method runs; nothing else is ever called.

What the engine does not know is injected by `workers/` as a start-up hook (`RankStartup`): the KV
side (the pool registered with a transport, the side-channel thread) and the enrollment of a stage
in etcd. The hook gets the built rank and returns a `RankSide`: what rank 0 is told in the ready
ack, the commands it adds, and what to close at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch
import zmq
import zmq.utils.monitor as zmq_monitor

from contract.errors import ProtocolError
from workers.engine import ctrl
from workers.engine.checkpoint import load_weights
from workers.engine.config import EngineConfig, ModelConfig, Parallel
from workers.engine.group import Wire, all_reduce_fn, make_group, process_env
from workers.engine.kv_cache import KVPool
from workers.engine.model import LlamaStage

log = logging.getLogger(__name__)
Answer = tuple[Any, ...]   # a command's answer frame (cmd, *args), or None: no answer


class RankDied(RuntimeError):
    pass


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
    kv_backend: str | None = None     # set: the start-up hook registers the pools and serves KV
    kv_host: str = "127.0.0.1"
    head: str = "127.0.0.1"           # where rank 0's store and control sockets listen
    backend: str = "gloo"             # the group's backend (group_backend of every rank's device)
    producer: bool = False            # a TP prefill rank: serves its KV heads over the side channel
    secret: bytes = b""               # the control channel's shared secret (never sent on it)
    store_path: str = ""              # spawned ranks: the group's FileStore (never from the network)


class RankSide(Protocol):
    """What a start-up hook adds to a rank."""
    info: dict[str, Any]                                  # told to rank 0 in the ready ack
    commands: Mapping[str, Callable[..., Answer | None]]  # commands beyond Rank.COMMANDS

    def close(self) -> None: ...                          # at stop, or when the head is gone


RankStartup = Callable[["Rank"], RankSide]


class Rank:
    """One rank's slice of the model, its KV pool and its end of the process group."""

    COMMANDS = frozenset({"forward", "write_kv", "read_kv", "ping"})

    def __init__(self, spec: RankSpec) -> None:
        torch.set_num_threads(1)
        self.spec = spec
        self.mc = ModelConfig.load(spec.checkpoint)
        self.dev = spec.engine.device
        self.dtype = spec.engine.torch_dtype
        self.group, _ = make_group(spec.rank, spec.world, spec.store_port, spec.head, spec.backend, self.dev,
                                   spec.store_path)
        self.wire = Wire(spec.backend, self.dev)
        weights = load_weights(spec.checkpoint, self.mc, spec.par, self.dtype, self.dev)
        self.model = LlamaStage(self.mc, spec.par, weights,
                                all_reduce_fn(self.group, self.wire.direct) if spec.kind == "tp" else None)
        self.pool = KVPool(len(self.model.layer_ids), spec.engine.num_blocks, self.model.kv_heads,
                           spec.engine.block_size, self.mc.head_dim, self.dtype, self.dev)

    # -- the commands (rank 0 calls them by name) --------------------------------------------

    def forward(self, raw_batch: Any, ids: torch.Tensor | None) -> None:
        """One step's batch; tensors cross processes in host memory, compute on this rank's device."""
        batch = ctrl.batch_in(raw_batch).to(self.dev)
        if self.spec.kind == "tp":
            assert ids is not None
            self.model.forward(batch, self.pool, input_ids=ids.to(self.dev))
            return
        # pp: hidden from the previous stage, to the next (or logits to stage 0)
        s = self.spec
        hidden = self.wire.buffer(len(batch.positions), self.mc.hidden_size, dtype=self.dtype)
        self.group.recv([hidden], s.rank - 1, 0).wait()
        out = self.wire.out(self.model.forward(batch, self.pool, hidden=self.wire.into(hidden)))
        self.group.send([out], (s.rank + 1) % s.world, 0).wait()

    def write_kv(self, layer: int, blocks: list[int], kv: torch.Tensor) -> None:
        """KV of `blocks` in a local layer ([n, 2, kv_heads, block_size, head_dim])."""
        if self._kv_args_ok(layer, blocks):
            self.pool.layers[layer][torch.tensor(blocks, device=self.dev)] = kv.to(device=self.dev, dtype=self.dtype)

    def read_kv(self, layer: int, blocks: list[int]) -> Answer:
        if not self._kv_args_ok(layer, blocks):
            return ("error", "bad layer or block ids")
        return ("tensor", self.pool.layers[layer][torch.tensor(blocks, device=self.dev)].cpu())

    def ping(self) -> Answer:
        return ("pong",)

    def _kv_args_ok(self, layer: int, blocks: list[int]) -> bool:
        layers = self.pool.layers
        if 0 <= layer < len(layers) and all(0 <= b < layers[layer].shape[0] for b in blocks):
            return True
        log.error("rank %d: KV command for layer %d, blocks out of the pool: refused", self.spec.rank, layer)
        return False

    # -- serving ------------------------------------------------------------------------------

    def serve(self, sock: zmq.Socket, side: RankSide | None, monitor: zmq.Socket | None = None) -> None:
        """Run rank 0's commands until `stop` (or, for a remote stage, until the head is gone)."""
        extra = side.commands if side is not None else {}
        try:
            while True:
                if monitor is not None and not sock.poll(1000):
                    if _disconnected(monitor):
                        raise RankDied(f"stage {self.spec.rank}: the pipeline head at {self.spec.head} is gone")
                    continue
                try:
                    cmd, args = ctrl.unpack(sock.recv())
                except ProtocolError as e:  # the peer proved the secret: a bug, not an attack; say so, go on
                    log.error("rank %d: bad control frame: %s", self.spec.rank, e.message)
                    continue
                if cmd == "stop":
                    return
                if cmd in self.COMMANDS:
                    answer = getattr(self, cmd)(*args)
                elif cmd in extra:
                    answer = extra[cmd](*args)
                else:
                    log.error("rank %d: %r is not a command of this rank", self.spec.rank, cmd)
                    continue
                if answer is not None:
                    sock.send(ctrl.pack(*answer))
        finally:
            if side is not None:
                side.close()


def start_rank(spec: RankSpec, startup: RankStartup | None, ack: Callable[[Any], None]) -> tuple[Rank, RankSide | None] | None:
    """Build the rank and run its start-up hook; ack ("ready", rank, info) or ("error", traceback)."""
    try:
        rank = Rank(spec)
        side = startup(rank) if startup is not None and spec.kv_backend else None
    except Exception:  # noqa: BLE001 - reported to rank 0, which fails its start clearly
        ack(("error", traceback.format_exc()))
        return None
    ack(("ready", spec.rank, side.info if side is not None else {}))
    return rank, side


def rank_main(spec: RankSpec, ready: Any, startup: RankStartup | None) -> None:
    """A spawned rank's process: connect to rank 0, prove the secret, then build, ack and serve."""
    process_env()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{spec.ctrl_port}")
    try:
        stage_handshake(sock, spec.rank, spec.secret, 120.0, ("ok",))
        started = start_rank(spec, startup, ready.put)
        if started is not None:
            started[0].serve(sock, started[1])
    except (RankDied, ProtocolError) as e:
        ready.put(("error", str(e)))
    finally:
        sock.close(0)
        ctx.term()


def stage_handshake(sock: zmq.Socket, rank: int, secret: bytes, timeout: float, then: tuple[str, ...]) -> list[Any]:
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


def heartbeats(s: zmq.Socket) -> None:
    """ZMTP heartbeats: a peer on another host that vanished without a reset is noticed."""
    s.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    s.setsockopt(zmq.HEARTBEAT_TTL, 6000)


def _disconnected(monitor: zmq.Socket) -> bool:
    while monitor.poll(0):
        if zmq_monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            return True
    return False


def serve_remote_stage(head: str, port: int, pp_rank: int, checkpoint: str, kv_host: str,
                       connect_timeout: float = 600.0, startup: RankStartup | None = None) -> None:
    """`mesh stage`: one PP stage in its own process (its own pod), joining the pipeline whose
    head (`mesh prefill --remote-stages PORT`) listens at head:port. The head sends the spec; the
    stage builds its layers, joins the gloo group, acks, and serves until `stop` or until the
    head is gone (then it exits, to be restarted and join the next head)."""
    secret = ctrl.pipeline_secret(required=True)
    assert secret is not None
    process_env()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    heartbeats(sock)
    sock.connect(f"tcp://{head}:{port + pp_rank}")
    try:
        try:
            (raw,) = stage_handshake(sock, pp_rank, secret, connect_timeout, ("spec",))
            spec = ctrl.spec_in(raw, RankSpec)
        except ProtocolError as e:
            raise RankDied(f"the head at {head}:{port + pp_rank}: {e.message}") from None
        spec = dataclasses.replace(spec, checkpoint=checkpoint, kv_host=kv_host, head=head, secret=secret)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            started = start_rank(spec, startup, lambda msg: sock.send(ctrl.pack(*msg)))
            if started is not None:
                started[0].serve(sock, started[1], monitor)
        finally:
            sock.disable_monitor()
            monitor.close(0)
    finally:
        sock.close(0)
        ctx.term()
