"""KV side channel (docs/protocol.md section 6): write_request / write_done / release over ZMQ.

Shared by the mock fleet and the real worker adapters. Push mode: the consumer (decode)
asks every prefill stage to write; each stage writes its layers into every consumer rank
(one batched write per (stage, rank), done by the `writer` it was given) and reports
`write_done`, possibly more than once. The consumer completes a receive only when it holds
an ok `write_done` from every distinct (pp_rank, tp_rank) pair with the right nonce, then
each consumer rank sends `release` to stage 0, which frees the blocks once all ranks did.

Sockets: each stage binds a ROUTER on its kv port; the consumer binds a ROUTER on its
notify port; senders use one DEALER per peer address, kept open.

Size: the producer and consumer ends of one protocol, kept together so each frame's sender and
receiver (and their checks) read side by side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import random
import secrets
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

import msgpack
import zmq
import zmq.asyncio

from contract.errors import KVTransferError, ProtocolError
from contract.protocol import (
    ConsumerRank,
    KVHandoffParams,
    Release,
    WriteDone,
    WriteRequest,
    decode_frame,
    encode_frame,
)

log = logging.getLogger(__name__)

WORKER_TOKEN_ENV = "ATOMESH_WORKER_TOKEN"


def worker_token() -> str | None:
    """The worker token shared by the mesh and its workers (`ATOMESH_WORKER_TOKEN`), or None. With
    it, a worker serves `/kv/*` and PD legs only to callers that present it, and every side-channel
    write request and release carries an HMAC keyed by it."""
    t = os.environ.get(WORKER_TOKEN_ENV)
    if t is None or t == "":
        return None
    if len(t) < 16:
        raise ValueError(f"{WORKER_TOKEN_ENV} must be at least 16 characters")
    return t


def _mac(token: str, *parts: object) -> str:
    return hmac.new(token.encode(), msgpack.packb(list(parts)), "sha256").hexdigest()


def write_mac(token: str, req: WriteRequest) -> str:
    """What authenticates a write request: every field that says what is read and where it goes."""
    return _mac(token, "write_request", req.request_id, req.transfer_id, list(req.src_block_ids),
                list(req.dst_block_ids), [[r.tp_rank, r.segment, r.head_start, r.head_end, list(r.region_addrs)]
                                          for r in req.ranks], req.notify_host, req.notify_port, req.write_nonce,
                req.extra.get("kv_grant", ""), req.extra.get("layout") or {})


def release_mac(token: str, transfer_id: str, tp_rank: int) -> str:
    return _mac(token, "release", transfer_id, tp_rank)


@dataclass(frozen=True, slots=True)
class ChannelFaults:
    """Fault injection for tests and soak runs (all off by default)."""
    drop_write_done: float = 0.0   # fraction of write_done sends dropped
    drop_release: float = 0.0      # fraction of release sends dropped
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("drop_write_done", "drop_release"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")


@dataclass(slots=True)
class ChannelStats:
    write_requests: int = 0
    write_done_sent: int = 0
    write_done_dropped: int = 0
    duplicate_write_done: int = 0
    wrong_nonce: int = 0
    stray_write_done: int = 0
    releases_sent: int = 0
    releases_dropped: int = 0
    releases_received: int = 0
    duplicate_releases: int = 0
    bad_frames: int = 0
    unauthenticated: int = 0        # write requests / releases without the worker token's HMAC: dropped


class Holder(Protocol):
    """What a stage needs from the pipeline's block holder."""

    def blocks_of(self, transfer_id: str) -> tuple[int, ...] | None: ...

    def expect_consumers(self, transfer_id: str, tp_size: int) -> None:
        """Stage 0 learns from a write_request how many consumer ranks will release."""
        ...

    def release_rank(self, transfer_id: str, tp_rank: int) -> bool:
        """Record one consumer rank's release; True when this call changed anything."""
        ...


Writer = Callable[[WriteRequest, ConsumerRank], Awaitable[None]]


_DONTWAIT = int(zmq.DONTWAIT)
_send_now = zmq.Socket.send   # the blocking-socket send, on the asyncio socket's own handle


class _Dealers:
    """One DEALER per peer address, opened on first use; `send` to one of them."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self._ctx = ctx
        self._socks: dict[tuple[str, int], zmq.asyncio.Socket] = {}
        self._waiting: dict[zmq.asyncio.Socket, int] = {}   # sends awaiting room, per socket

    async def send(self, sock: zmq.asyncio.Socket, frame: bytes) -> None:
        """pyzmq's asyncio send first tries a non-blocking send too, through a future, two kwargs
        dicts and IntFlag arithmetic per call (a side channel sends five frames per PD request);
        this makes that try directly and awaits only when the socket has no room. Behind a send
        that waits, later ones wait too: frames leave in order."""
        if not self._waiting.get(sock):
            try:
                _send_now(sock, frame, _DONTWAIT)
                return
            except zmq.Again:
                pass
        self._waiting[sock] = self._waiting.get(sock, 0) + 1
        try:
            await sock.send(frame)
        finally:
            self._waiting[sock] -= 1

    def get(self, host: str, port: int) -> zmq.asyncio.Socket:
        sock = self._socks.get((host, port))
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(f"tcp://{host}:{port}")
            self._socks[(host, port)] = sock
        return sock

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
        self._waiting.clear()


class StageChannel:
    """The producer side of one prefill stage: serves write_request and (stage 0) release."""

    def __init__(self, *, host: str, port: int, pp_rank: int, holder: Holder | None, writer: Writer,
                 write_done_repeats: int = 3, faults: ChannelFaults = ChannelFaults(),
                 grant_key: bytes | None = None, token: str | None = None) -> None:
        """`grant_key` (a stage without the holder): serve only write requests that carry stage 0's
        grant for their transfer and blocks (`ctrl.kv_grant`). `token` (the worker token): serve
        only write requests and releases signed with it (`write_mac`, `release_mac`)."""
        self._grant_key = grant_key
        self._token = token
        if write_done_repeats < 1:
            raise ValueError("write_done_repeats must be >= 1")
        self.host, self.port, self.pp_rank = host, port, pp_rank
        self._holder, self._writer = holder, writer
        self._repeats = write_done_repeats
        self.faults = faults
        self._rng = random.Random(faults.seed)
        self._ctx = zmq.asyncio.Context.instance()
        self._router: zmq.asyncio.Socket | None = None
        self._dealers = _Dealers(self._ctx)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self.stats = ChannelStats()

    async def start(self) -> None:
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        if self.port == 0:
            self.port = self._router.bind_to_random_port(f"tcp://{self.host}")
        else:
            self._router.bind(f"tcp://{self.host}:{self.port}")
        self._loop_task = asyncio.create_task(self._serve(), name=f"kv-stage-{self.pp_rank}")

    async def close(self) -> None:
        for t in [self._loop_task, *self._tasks]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*[t for t in [self._loop_task, *self._tasks] if t], return_exceptions=True)
        self._dealers.close()
        if self._router is not None:
            self._router.close(0)

    async def _serve(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            try:
                self._handle(frames[-1])
            except Exception as e:  # noqa: BLE001 - one frame, whatever it is, never ends the loop
                self.stats.bad_frames += 1
                if self.stats.bad_frames & (self.stats.bad_frames - 1) == 0:  # 1st, 2nd, 4th...: no log flood
                    log.warning("stage %d: bad side-channel frame (%d so far): %s", self.pp_rank,
                                self.stats.bad_frames, e)

    def _handle(self, frame: bytes) -> None:
        msg = decode_frame(frame)
        if self._token is not None and not self._signed(msg):
            self.stats.unauthenticated += 1
            if self.stats.unauthenticated & (self.stats.unauthenticated - 1) == 0:
                log.warning("stage %d: %d side-channel frame(s) without the worker token's signature dropped",
                            self.pp_rank, self.stats.unauthenticated)
            return
        if isinstance(msg, WriteRequest):
            self.stats.write_requests += 1
            t = asyncio.create_task(self._write(msg))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        elif isinstance(msg, Release):
            self.stats.releases_received += 1
            if self._holder is None or not self._holder.release_rank(msg.transfer_id, msg.tp_rank):
                self.stats.duplicate_releases += 1
        else:
            self.stats.bad_frames += 1

    def _signed(self, msg: object) -> bool:
        assert self._token is not None
        if isinstance(msg, WriteRequest):
            got, want = msg.extra.get("auth"), write_mac(self._token, msg)
        elif isinstance(msg, Release):
            got, want = msg.auth, release_mac(self._token, msg.transfer_id, msg.tp_rank)
        else:
            return True   # not a request: counted as a bad frame below
        return isinstance(got, str) and hmac.compare_digest(got, want)

    async def _write(self, req: WriteRequest) -> None:
        # stage 0 holds the transfer; later stages serve the block ids stage 0 granted (holder None)
        held = self._holder.blocks_of(req.transfer_id) if self._holder is not None else req.src_block_ids
        if self._holder is None and self._grant_key is not None:
            from workers.engine.ctrl import kv_grant

            want = kv_grant(self._grant_key, req.transfer_id, req.src_block_ids)
            if not hmac.compare_digest(want, str(req.extra.get("kv_grant", ""))):
                held = None
        if held is not None and self._holder is not None:
            self._holder.expect_consumers(req.transfer_id, len(req.ranks))
        for rank in req.ranks:
            ok, error = True, ""
            if held is None:
                ok, error = False, f"transfer {req.transfer_id} is not held by stage {self.pp_rank}"
            elif not set(req.src_block_ids) <= set(held) or len(req.src_block_ids) != len(req.dst_block_ids):
                ok, error = False, "src_block_ids do not match the held blocks"
            else:
                try:
                    await self._writer(req, rank)
                except Exception as e:  # noqa: BLE001 - a failed write is reported, not raised
                    ok, error = False, f"stage {self.pp_rank} write to rank {rank.tp_rank} failed: {e}"
            done = WriteDone(request_id=req.request_id, transfer_id=req.transfer_id,
                             pp_rank=self.pp_rank, tp_rank=rank.tp_rank,
                             write_nonce=req.write_nonce, ok=ok, error=error)
            frame = encode_frame(done)
            sock = self._dealers.get(req.notify_host, req.notify_port)
            for _ in range(self._repeats):
                if self.faults.drop_write_done and self._rng.random() < self.faults.drop_write_done:
                    self.stats.write_done_dropped += 1
                    continue
                await self._dealers.send(sock, frame)
                self.stats.write_done_sent += 1


@dataclass(slots=True)
class _Receive:
    nonce: int
    expected: int
    future: asyncio.Future[None]
    got: set[tuple[int, int]] = field(default_factory=set)


class _PullTimeout(Exception):
    pass


def _time_out(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(_PullTimeout())


class ConsumerChannel:
    """The consumer side (a decode engine): asks stages to write, waits for all write_dones."""

    def __init__(self, *, host: str, port: int = 0, faults: ChannelFaults = ChannelFaults(),
                 token: str | None = None) -> None:
        """`token` (the worker token): sign every write request and release with it."""
        self.host, self.port = host, port
        self._token = token
        self.faults = faults
        self._rng = random.Random(faults.seed)
        self._ctx = zmq.asyncio.Context.instance()
        self._router: zmq.asyncio.Socket | None = None
        self._dealers = _Dealers(self._ctx)
        self._pending: dict[str, _Receive] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self.stats = ChannelStats()

    async def start(self) -> None:
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        if self.port == 0:
            self.port = self._router.bind_to_random_port(f"tcp://{self.host}")
        else:
            self._router.bind(f"tcp://{self.host}:{self.port}")
        self._loop_task = asyncio.create_task(self._serve(), name="kv-consumer")

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for r in self._pending.values():
            if not r.future.done():
                r.future.set_exception(KVTransferError("consumer channel closed"))
        self._dealers.close()
        if self._router is not None:
            self._router.close(0)

    async def pull(self, params: KVHandoffParams, ranks: tuple[ConsumerRank, ...],
                   dst_block_ids: tuple[int, ...], *, request_id: str, deadline_s: float,
                   extra: dict[str, object] | None = None) -> None:
        """Ask every stage to write; return once every (pp_rank, tp_rank) reported ok."""
        if params.transfer_id in self._pending:
            raise KVTransferError(f"transfer {params.transfer_id} is already being received")
        stages = params.stage_addrs()
        if len(stages) != params.remote_pp_size:
            raise KVTransferError(f"transfer {params.transfer_id}: {len(stages)} stages listed "
                                  f"for remote_pp_size {params.remote_pp_size}")
        nonce = secrets.randbits(64)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[params.transfer_id] = _Receive(nonce, len(stages) * len(ranks), fut)
        req = WriteRequest(request_id=request_id, transfer_id=params.transfer_id,
                           src_block_ids=params.remote_block_ids, dst_block_ids=dst_block_ids,
                           ranks=ranks, notify_host=self.host, notify_port=self.port,
                           write_nonce=nonce,
                           extra={**(extra or {}), **({"kv_grant": params.extra["kv_grant"]}
                                                      if isinstance(params.extra.get("kv_grant"), str) else {})})
        if self._token is not None:
            req = dataclasses.replace(req, extra={**req.extra, "auth": write_mac(self._token, req)})
        frame = encode_frame(req)
        # the deadline as a timer on the future itself (no wait_for task and shield per pull: this
        # is every PD request's path); a caller that leaves cancels the future, which nobody else awaits
        timer = asyncio.get_running_loop().call_later(deadline_s, _time_out, fut)
        try:
            for st in stages:
                await self._dealers.send(self._dealers.get(st.host, st.port), frame)
            try:
                await fut
            except _PullTimeout:
                r = self._pending[params.transfer_id]
                raise KVTransferError(
                    f"transfer {params.transfer_id}: {len(r.got)}/{r.expected} write_done "
                    f"within {deadline_s:.1f}s") from None
        finally:
            timer.cancel()
            self._pending.pop(params.transfer_id, None)

    async def release(self, params: KVHandoffParams, tp_rank: int) -> None:
        """Tell stage 0 this consumer rank is done with the transfer's blocks."""
        if self.faults.drop_release and self._rng.random() < self.faults.drop_release:
            self.stats.releases_dropped += 1
            return
        st0 = params.stage_addrs()[0]
        msg = Release(transfer_id=params.transfer_id, tp_rank=tp_rank,
                      auth=release_mac(self._token, params.transfer_id, tp_rank) if self._token else "")
        await self._dealers.send(self._dealers.get(st0.host, st0.port), encode_frame(msg))
        self.stats.releases_sent += 1

    async def _serve(self) -> None:
        assert self._router is not None
        last = b""
        while True:
            frames = await self._router.recv_multipart()
            if frames[-1] == last:  # a stage's repeat of the write_done just handled: nothing new
                self.stats.duplicate_write_done += 1
                continue
            last = frames[-1]
            try:
                msg = decode_frame(last)
                if not isinstance(msg, WriteDone):
                    raise ProtocolError("not a write_done")
                self._on_write_done(msg)
            except Exception as e:  # noqa: BLE001 - one frame, whatever it is, never ends the loop
                self.stats.bad_frames += 1
                if self.stats.bad_frames & (self.stats.bad_frames - 1) == 0:
                    log.warning("decode side channel: bad frame (%d so far): %s", self.stats.bad_frames, e)

    def _on_write_done(self, msg: WriteDone) -> None:
        r = self._pending.get(msg.transfer_id)
        if r is None or r.future.done():
            self.stats.stray_write_done += 1
            return
        if msg.write_nonce != r.nonce:
            self.stats.wrong_nonce += 1
            return
        if not msg.ok:
            r.future.set_exception(KVTransferError(
                f"transfer {msg.transfer_id}: stage {msg.pp_rank} rank {msg.tp_rank}: {msg.error}"))
            return
        pair = (msg.pp_rank, msg.tp_rank)
        if pair in r.got:
            self.stats.duplicate_write_done += 1
            return
        r.got.add(pair)
        if len(r.got) == r.expected:
            r.future.set_result(None)
