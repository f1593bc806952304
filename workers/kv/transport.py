"""KV transports: one batched write of many (src, dst, length) ranges into a peer's registered memory.

`MooncakeTransport` uses Mooncake Transfer Engine (TCP with P2PHANDSHAKE here; RDMA and GPU
memory through the same calls where the hardware exists); every return code is checked and
`MC_TCP_PROGRESS_TIMEOUT_SEC` is set so a frozen peer fails fast. `ZmqTransport` ships the
bytes to a receiver thread in the peer process, which checks every range against its registered
regions before copying. `CudaIpcTransport` (both processes on one host, pools in GPU memory)
ships no bytes: the write names ranges of the producer's pools, exported as CUDA IPC handles, and
the consumer's receiver maps them (once) and copies device to device into its own regions. A process creates one transport, registers its KV pools, and tells peers
its `segment` (how to reach it) and the regions' base addresses.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import torch
import zmq

from contract.errors import KVTransferError

log = logging.getLogger(__name__)
BACKENDS = ("mooncake", "zmq", "cuda-ipc")


@dataclass(frozen=True, slots=True)
class Region:
    addr: int
    length: int
    flat: torch.Tensor | None = None  # device memory: a uint8 view to copy through (host: raw addresses)


class Transport(Protocol):
    name: str

    @property
    def segment(self) -> str: ...

    def register(self, tensors: list[torch.Tensor]) -> list[int]: ...

    def write(self, segment: str, src: list[int], dst: list[int], lengths: list[int]) -> None: ...

    def close(self) -> None: ...


class MooncakeTransport:
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", progress_timeout_s: int = 5) -> None:
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(progress_timeout_s))
        # Mooncake's own log level (its glog ignores GLOG_minloglevel): WARNING unless the worker
        # runs with --log-level DEBUG (workers/cli.py sets it first). One ERROR line stays at every
        # start: "Local segment descriptor not found" is TcpTransport::allocateLocalSegmentID asking
        # for a descriptor to extend before any exists (P2P-handshake mode logs the miss, then a new
        # one is made): upstream and harmless (docs/engines.md, Mooncake).
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        from mooncake.engine import TransferEngine

        self._te = TransferEngine()
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise KVTransferError(f"mooncake initialize({host}, P2PHANDSHAKE, {protocol}) returned {rc}")
        self._segment = f"{host}:{self._te.get_rpc_port()}"
        self._regions: list[Region] = []

    @property
    def segment(self) -> str:
        return self._segment

    def register(self, tensors: list[torch.Tensor]) -> list[int]:
        out = []
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("only contiguous tensors can be registered")
            if t.device.type != "cpu":
                raise KVTransferError("the bundled Mooncake build (mooncake-transfer-engine-non-cuda) moves host "
                                      "memory only: use --kv-backend zmq for KV pools on a GPU")
            addr, n = t.data_ptr(), t.numel() * t.element_size()
            rc = self._te.register_memory(addr, n)
            if rc != 0:
                raise KVTransferError(f"mooncake register_memory({addr:#x}, {n}) returned {rc}")
            self._regions.append(Region(addr, n))
            out.append(addr)
        return out

    MAX_BATCH = 1024   # ranges per Mooncake batch; larger batches are refused (seen: 4096 -> -1)

    def write(self, segment: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        for i in range(0, len(src), self.MAX_BATCH):
            j = i + self.MAX_BATCH
            rc = self._te.batch_transfer_sync_write(segment, src[i:j], dst[i:j], lengths[i:j])
            if rc != 0:
                raise KVTransferError(f"mooncake batch write of {len(src[i:j])} ranges to {segment} returned {rc}")

    def close(self) -> None:
        for r in self._regions:
            self._te.unregister_memory(r.addr)
        self._regions.clear()


class ZmqTransport:
    """Bytes over ZMQ to the peer's receiver thread, which copies them into its registered regions."""

    name = "zmq"

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 10.0, token: str | None = None) -> None:
        """`token`: the worker token (default: `ATOMESH_WORKER_TOKEN`'s); with it every write's
        header carries its HMAC, and the receiver drops a write whose HMAC is not right."""
        from workers.kv.sidechannel import worker_token

        self._token = (token or worker_token() or "").encode() or None
        self.unauthenticated = 0   # writes dropped for a missing or wrong HMAC
        self._ctx = zmq.Context()
        self._regions: list[Region] = []
        self._lock = threading.Lock()
        self._timeout_ms = int(timeout_s * 1000)
        self._recv = self._ctx.socket(zmq.ROUTER)
        self._recv.setsockopt(zmq.LINGER, 0)
        port = self._recv.bind_to_random_port(f"tcp://{host}")
        self._segment = f"tcp://{host}:{port}"
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="kv-zmq-receiver", daemon=True)
        self._thread.start()
        self._out: dict[str, zmq.Socket] = {}
        self._out_lock = threading.Lock()
        self._peer_locks: dict[str, threading.Lock] = {}
        self._streams: dict[torch.device, Any] = {}   # the receiver's copy stream per device (`_device_copies`)

    @property
    def segment(self) -> str:
        return self._segment

    def register(self, tensors: list[torch.Tensor]) -> list[int]:
        out = []
        with self._lock:
            for t in tensors:
                if not t.is_contiguous():
                    raise ValueError("only contiguous tensors can be registered")
                flat = t.view(-1).view(torch.uint8) if t.device.type != "cpu" else None
                self._regions.append(Region(t.data_ptr(), t.numel() * t.element_size(), flat))
                out.append(t.data_ptr())
        return out

    def _region(self, addr: int, n: int) -> Region | None:
        for r in self._regions:
            if r.addr <= addr and addr + n <= r.addr + r.length:
                return r
        return None

    def _inside(self, addr: int, n: int) -> bool:
        return self._region(addr, n) is not None

    def _read(self, src: list[int], lengths: list[int]) -> bytes:
        """The source ranges' bytes: host memory directly, device memory in one gather + copy."""
        regs = [self._region(s, n) for s, n in zip(src, lengths)]
        if any(r is None or n <= 0 for r, n in zip(regs, lengths)):
            raise KVTransferError("a source range is outside the registered pools")
        if all(r is None or r.flat is None for r in regs):
            return b"".join(ctypes.string_at(s, n) for s, n in zip(src, lengths))
        parts = []
        for s, n, r in zip(src, lengths, regs):
            if r is None:
                raise KVTransferError(f"source range {s:#x}+{n} is not registered")
            parts.append(r.flat[s - r.addr:s - r.addr + n] if r.flat is not None
                         else torch.frombuffer(bytearray(ctypes.string_at(s, n)), dtype=torch.uint8))
        return torch.cat([p.cpu() for p in parts]).numpy().tobytes()

    def _device_copies(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """(destination, source) device copies, done before the write is acknowledged: on the
        receiver's own stream per device, waited for on that stream alone. Not the legacy default
        stream, which every other stream waits on, nor a device-wide synchronize: either, from
        this thread while the engine's thread captures a decode graph, would break that capture
        (and stall its steps). The destination blocks are free on the host, so no step in flight
        touches them (a step run ahead fences the blocks it still writes: `Engine._fence`)."""
        used = []
        for dst, src in copies:
            st = self._streams.get(dst.device)
            if st is None:
                st = self._streams[dst.device] = torch.cuda.Stream(device=dst.device)
            if st not in used:
                used.append(st)
            with torch.cuda.stream(st):
                dst.copy_(src)
        for st in used:
            st.synchronize()

    def _land(self, dst: list[int], lengths: list[int], buf: memoryview) -> None:
        """Copy the payload into the destination ranges (device ones through one host tensor)."""
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if len(buf) else 0
        host: torch.Tensor | None = None
        copies = []
        off = 0
        for d, n in zip(dst, lengths):
            r = self._region(d, n)
            assert r is not None
            if r.flat is None:
                ctypes.memmove(d, base + off, n)
            else:
                if host is None:
                    with warnings.catch_warnings():  # a read-only frame: only read from here
                        warnings.simplefilter("ignore", UserWarning)
                        host = torch.frombuffer(buf, dtype=torch.uint8)
                copies.append((r.flat[d - r.addr:d - r.addr + n], host[off:off + n]))
            off += n
        self._device_copies(copies)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._recv, zmq.POLLIN)
        while not self._stop:
            if not poller.poll(200):
                continue
            frames = self._recv.recv_multipart(copy=False)
            try:
                err = self._receive(self._verified(frames))
            except KVTransferError as e:
                err = str(e)
            except Exception as e:  # noqa: BLE001 - a frame, whatever it is, never ends the receiver
                err = f"bad KV frame: {e.__class__.__name__}"
            if err:
                log.warning("%s KV receiver: %s", self.name, err)
            if len(frames) >= 1:
                self._recv.send_multipart([frames[0].bytes, err.encode()])

    def _mac(self, head: bytes) -> bytes:
        assert self._token is not None
        return hmac.new(self._token, head, hashlib.sha256).digest()

    def _verified(self, frames: list[Any]) -> list[Any]:
        """Without a token, the frames as they came; with one, the frames less the HMAC frame that
        follows the identity, which must be the header's (the frame after it); else refused."""
        if self._token is None:
            return frames
        if len(frames) < 3 or not hmac.compare_digest(frames[1].bytes, self._mac(frames[2].bytes)):
            self.unauthenticated += 1
            raise KVTransferError("a KV write without the worker token's HMAC")
        return [frames[0], *frames[2:]]

    def _receive(self, frames: list[Any]) -> str:
        """One KV write: [ident, msgpack [dst addrs, lengths], payload]; every range positive, inside
        a registered region, and the lengths summing to the payload; else refused, nothing landed."""
        if len(frames) != 3:
            return f"{len(frames)} frames where 3 are due"
        head = msgpack.unpackb(frames[1].bytes)
        if not (isinstance(head, list) and len(head) == 2 and all(isinstance(x, list) for x in head)
                and len(head[0]) == len(head[1])
                and all(type(v) is int for x in head for v in x)):
            return "bad KV frame header"
        dst, lengths = head
        buf = frames[2].buffer
        if any(n <= 0 for n in lengths) or any(d < 0 for d in dst):
            return "ranges must have positive lengths and addresses"
        with self._lock:
            bad = [(d, n) for d, n in zip(dst, lengths) if not self._inside(d, n)]
            if bad or sum(lengths) != len(buf):
                return f"{len(bad)} range(s) outside the registered regions" if bad else "payload size mismatch"
            self._land(dst, lengths, buf)
        return ""

    def write(self, segment: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        if not src:
            return
        with self._lock:
            payload = self._read(src, lengths)
        self._send(segment, [msgpack.packb([dst, lengths]), payload])

    def _send(self, segment: str, frames: list[Any]) -> None:
        """One write's frames to the peer's receiver, and its answer (an error refuses the write)."""
        with self._out_lock:  # one socket and one lock per peer: a stalled peer blocks only its own writes
            lock = self._peer_locks.setdefault(segment, threading.Lock())
        with lock:
            sock = self._out.get(segment)
            if sock is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(segment)
                self._out[segment] = sock
            sock.send_multipart([self._mac(frames[0]), *frames] if self._token is not None else frames, copy=False)
            if not sock.poll(self._timeout_ms):
                sock.close(0)
                del self._out[segment]
                raise KVTransferError(f"zmq KV write to {segment}: no answer within {self._timeout_ms} ms")
            err = sock.recv().decode()
        if err:
            raise KVTransferError(f"zmq KV write to {segment} refused: {err}")

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        for s in self._out.values():
            s.close(0)
        self._recv.close(0)
        self._ctx.term()


@dataclass(frozen=True, slots=True)
class _Export:
    """A registered device region as CUDA IPC exports it (torch's `_share_cuda_`): the handle of
    the allocation that holds it, and where the region starts in that allocation."""
    fields: tuple[Any, ...]   # (device, handle, allocation bytes, offset, ref-counter handle and offset, event, sync)
    start: int                # the region's first byte, past the storage's start

    def wire(self) -> list[Any]:
        return [*self.fields, self.start]


class CudaIpcTransport(ZmqTransport):
    """Device-to-device on one host: a write sends, over the receiver's socket, the producer's
    regions as CUDA IPC handles and (region, offset) sources instead of the bytes; the receiver
    checks the frame as the ZMQ one (every destination inside its regions) and every source inside
    the exported region, maps each producer allocation once, and copies on its own GPU before it
    answers. The producer's KV is complete when it asks (its step waited for the GPU); the
    receiver's copies go on its own copy stream (`ZmqTransport._device_copies`)."""

    name = "cuda-ipc"

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 10.0, token: str | None = None) -> None:
        self._exports: list[_Export | None] = []
        self._mapped: dict[tuple[bytes, int, int], torch.Tensor] = {}
        super().__init__(host, timeout_s, token)

    def register(self, tensors: list[torch.Tensor]) -> list[int]:
        out = super().register(tensors)
        with self._lock:
            for t in tensors:
                if t.device.type != "cuda":
                    self._exports.append(None)
                    continue
                st = t.untyped_storage()
                self._exports.append(_Export(tuple(st._share_cuda_()), t.data_ptr() - st.data_ptr()))
        return out

    def write(self, segment: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        if not src:
            return
        with self._lock:
            where = []
            exports: dict[int, list[Any]] = {}
            for s, n in zip(src, lengths):
                r = self._region(s, n)
                i = self._regions.index(r) if r is not None else -1
                e = self._exports[i] if r is not None else None
                if r is None or n <= 0 or e is None:
                    raise KVTransferError("a source range is outside the registered device pools")
                where.append((i, s - r.addr))
                if i not in exports:
                    exports[i] = e.wire()
            used = sorted(exports)
        head = msgpack.packb([dst, lengths, [i for i, _ in where], [o for _, o in where],
                              [[i, *exports[i]] for i in used], [self._regions[i].length for i in used]])
        self._send(segment, [head])

    def _receive(self, frames: list[Any]) -> str:
        """[ident, msgpack [dst, lengths, source regions, source offsets, exports, export lengths]]:
        every destination inside a registered region, every source inside the exported region it
        names; else refused, nothing copied."""
        if len(frames) != 2:
            return f"{len(frames)} frames where 2 are due"
        head = msgpack.unpackb(frames[1].bytes)
        if not (isinstance(head, list) and len(head) == 6 and all(isinstance(x, list) for x in head)):
            return "bad KV frame header"
        dst, lengths, regs, offs, exports, sizes = head
        if not (len(dst) == len(lengths) == len(regs) == len(offs) and len(exports) == len(sizes)
                and all(type(v) is int for x in (dst, lengths, regs, offs, sizes) for v in x)):
            return "bad KV frame header"
        table: dict[int, tuple[list[Any], int, int]] = {}   # region -> (export, start, length)
        for e, size in zip(exports, sizes):
            if not (isinstance(e, list) and len(e) == 10 and type(e[0]) is int and type(e[1]) is int
                    and isinstance(e[2], bytes) and all(type(e[k]) is int for k in (3, 4, 6, 9))
                    and isinstance(e[5], bytes) and isinstance(e[7], bytes) and type(e[8]) is bool
                    and e[4] >= 0 and e[9] >= 0 and 0 < size and e[9] + size <= e[3]):
                return "bad CUDA IPC export"
            table[e[0]] = (e[1:9], e[9], size)   # the mapped storage, the region's start and length in it
        if any(n <= 0 for n in lengths) or any(d < 0 for d in dst) or any(o < 0 for o in offs):
            return "ranges must have positive lengths and addresses"
        if any(r not in table or o + n > table[r][2] for r, o, n in zip(regs, offs, lengths)):
            return "a source range is outside the exported regions"
        with self._lock:
            bad = [(d, n) for d, n in zip(dst, lengths) if not self._inside(d, n)]
            if bad:
                return f"{len(bad)} range(s) outside the registered regions"
            targets = [self._region(d, n) for d, n in zip(dst, lengths)]
            if any(t is None or t.flat is None for t in targets):
                return "a destination is not in device memory"
            srcs = {r: (self._map(fields), start) for r, (fields, start, _) in table.items()}
            copies = []
            for d, n, t, r, o in zip(dst, lengths, targets, regs, offs):
                assert t is not None and t.flat is not None
                mem, start = srcs[r]
                copies.append((t.flat[d - t.addr:d - t.addr + n], mem[start + o:start + o + n]))
            self._device_copies(copies)   # before the answer: the producer frees after it
        return ""

    def _map(self, fields: list[Any]) -> torch.Tensor:
        """A producer's allocation, opened once (the mapping lives as long as this transport)."""
        key = (bytes(fields[1]), fields[3], fields[2])   # allocation, the storage's offset and size in it
        got = self._mapped.get(key)
        if got is None:
            st = torch.UntypedStorage._new_shared_cuda(*fields)
            got = torch.empty(0, dtype=torch.uint8, device=f"cuda:{fields[0]}").set_(st)
            self._mapped[key] = got
        return got

    def close(self) -> None:
        super().close()
        self._mapped.clear()


def create(backend: str, host: str = "127.0.0.1", token: str | None = None) -> Transport:
    """`token`: the ZMQ and CUDA IPC planes' worker token (default: `ATOMESH_WORKER_TOKEN`'s)."""
    if backend == "mooncake":
        return MooncakeTransport(host)
    if backend == "zmq":
        return ZmqTransport(host, token=token)
    if backend == "cuda-ipc":
        return CudaIpcTransport(host, token=token)
    raise ValueError(f"kv backend must be one of {BACKENDS}, got {backend!r}")


@dataclass(frozen=True, slots=True)
class Layout:
    """How KV blocks sit in a pool tensor `[num_blocks, 2, kv_heads, block_size, head_dim]`."""
    kv_heads: int
    block_size: int
    head_dim: int
    elem: int

    def head_span(self) -> int:
        return self.block_size * self.head_dim * self.elem

    def offset(self, block: int, kv: int, head: int) -> int:
        return ((block * 2 + kv) * self.kv_heads + head) * self.head_span()


def copy_plan(src_bases: list[int], src: Layout, dst_bases: list[int], dst: Layout, head_start: int,
              head_end: int, src_blocks: list[int], dst_blocks: list[int],
              src_head0: int = 0) -> tuple[list[int], list[int], list[int]]:
    """Ranges that move this producer's layers into a consumer rank's blocks. The consumer holds
    KV heads [head_start, head_end); the producer holds [src_head0, src_head0 + src.kv_heads) (all
    heads for a PP stage, a slice for a TP prefill rank): what both hold moves, maybe nothing.
    `src_bases[i]` and `dst_bases[i]` are the same layer's pool in both processes."""
    if src.block_size != dst.block_size or src.head_dim != dst.head_dim or src.elem != dst.elem:
        raise KVTransferError(f"KV layouts differ: producer {src}, consumer {dst}")
    if head_end - head_start != dst.kv_heads or head_start < 0 or src_head0 < 0:
        raise KVTransferError(f"head range [{head_start}, {head_end}) does not fit the consumer's {dst.kv_heads}")
    a, b = max(head_start, src_head0), min(head_end, src_head0 + src.kv_heads)
    if a >= b:
        return [], [], []  # this producer holds none of the consumer's heads
    n = (b - a) * src.head_span()
    s_out: list[int] = []
    d_out: list[int] = []
    l_out: list[int] = []
    for sb_base, db_base in zip(src_bases, dst_bases):
        for sb, db in zip(src_blocks, dst_blocks):
            for kv in (0, 1):
                s, d = sb_base + src.offset(sb, kv, a - src_head0), db_base + dst.offset(db, kv, a - head_start)
                if l_out and s_out[-1] + l_out[-1] == s and d_out[-1] + l_out[-1] == d:
                    l_out[-1] += n          # contiguous on both sides: one range
                else:
                    s_out.append(s)
                    d_out.append(d)
                    l_out.append(n)
    return s_out, d_out, l_out
