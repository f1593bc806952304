"""Typed messages of the Atomesh wire protocol (docs/protocol.md, v1).

One definition per message, used by the mesh, the real worker adapters and the mock fleet
alike. Every message keeps unknown fields in `extra` and writes them back on `encode()`.
Sections refer to docs/protocol.md.
"""

from __future__ import annotations

from typing import Any

import msgpack

from contract.codec import Message, message
from contract.dialects import ATOM
from contract.errors import ProtocolError

PROTOCOL_VERSION = 1
KV_PULL_HEADER = "x-atomesh-kv-pull-ms"   # a decode worker's answer: how long its KV pull took (ms)

# -- section 8: worker capabilities (what a worker serves beyond OpenAI) -----------------------
HOLDER_API = "holder_api"                  # GET /kv/held, POST /kv/release (section 7)
FIRST_TOKEN_EARLY = "first_token_early"    # the decode honours first_token_early, never emits T0 itself
LOAD_V1 = "load_v1"                        # GET /load answers LoadReport
CAPABILITIES = (HOLDER_API, FIRST_TOKEN_EARLY, LOAD_V1)
OWN_CAPABILITIES = CAPABILITIES            # what this project's workers and mock fleet declare
# how a worker moves KV (records say it for operators; the dialect says how the mesh drives the legs):
# the reference engine's three (cuda-ipc: device to device on one host), and NIXL (vLLM's NixlConnector, SGLang's nixl backend)
KV_BACKENDS = ("mooncake", "zmq", "cuda-ipc", "nixl")


def check_capabilities(caps: tuple[str, ...], where: str = "capabilities") -> tuple[str, ...]:
    for c in caps:
        if c not in CAPABILITIES:
            raise ProtocolError(f"{where}: unknown capability {c!r}; one of {', '.join(CAPABILITIES)}",
                                param=where)
    return tuple(dict.fromkeys(caps))


# -- section 2: registry records ------------------------------------------------------------

@message
class StageRecord(Message):
    """One stage of a prefill pipeline: where its KV side channel listens, which layers it owns."""
    pp_rank: int
    host: str
    kv_port: int
    layers: tuple[int, ...]  # [start, end)


@message
class PrefillRecord(Message):
    """`prefill/<pipeline_id>`: a prefill pipeline, routed to as one unit."""
    id: str
    model: str
    url: str
    pp_size: int = 1
    tp_size: int = 1
    block_size: int = 16
    num_blocks: int = 0
    kv_backend: str = "zmq"
    dialect: str = ATOM.value
    stages: tuple[StageRecord, ...] = ()
    draining: bool = False
    dp_size: int = 1                       # data-parallel ranks behind the url (ATOM decode enrichment)
    capabilities: tuple[str, ...] = ()     # section 8
    api_key_env: str = ""                  # the mesh sends Bearer $<this env var> to the worker (never the key)


@message
class StageLiveness(Message):
    """`prefill/<pipeline_id>/stage/<pp_rank>`: one stage is alive (under its own lease)."""
    pid: int
    host: str
    kv_port: int
    started_at: float


@message
class RankRecord(Message):
    tp_rank: int
    host: str
    segment: str = ""


@message
class DecodeRecord(Message):
    """`decode/<engine_id>`: a decode engine (tp_size ranks behind one HTTP url)."""
    id: str
    model: str
    url: str
    tp_size: int = 1
    block_size: int = 16
    num_blocks: int = 0
    kv_backend: str = "zmq"
    dialect: str = ATOM.value
    ranks: tuple[RankRecord, ...] = ()
    draining: bool = False
    capabilities: tuple[str, ...] = ()     # section 8
    api_key_env: str = ""                  # the mesh sends Bearer $<this env var> to the worker (never the key)


@message
class MeshRecord(Message):
    """`mesh/<mesh_id>`: a mesh replica."""
    url: str
    version: str
    started_at: float


# -- sections 4-5: kv_transfer_params ---------------------------------------------------------

@message
class KVRequestParams(Message):
    """mesh -> prefill: where the KV will go (the decode engine picked for this request)."""
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_handshake_port: int
    remote_tp_size: int
    remote_dp_size: int = 1
    do_remote_decode: bool = True
    do_remote_prefill: bool = False


@message
class StageAddr(Message):
    pp_rank: int
    host: str
    port: int
    layers: tuple[int, ...] = ()


@message
class KVHandoffParams(Message):
    """prefill -> mesh -> decode: where the KV is held and how to pull it."""
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: tuple[int, ...]
    transfer_id: str
    first_token_id: int
    remote_handshake_port: int = 0
    remote_pp_size: int = 1
    tp_size: int = 1
    dp_rank: int = 0
    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    stages: tuple[StageAddr, ...] = ()

    def stage_addrs(self, dp_size: int = 1) -> tuple[StageAddr, ...]:
        """The stages to pull from: `stages` when given, else ATOM's port layout (section 4)."""
        if self.stages:
            return self.stages
        step = dp_size * self.tp_size
        return tuple(
            StageAddr(pp_rank=r, host=self.remote_host,
                      port=self.remote_handshake_port + r * step + self.dp_rank * self.tp_size)
            for r in range(self.remote_pp_size))


def handoff_for_decode(raw: dict[str, Any]) -> dict[str, Any]:
    """Section 5: every field of the prefill's params, verbatim, flipped for the decode side."""
    out = dict(raw)
    out["do_remote_prefill"] = True
    out["do_remote_decode"] = False
    return out


# -- section 6: KV side channel (msgpack frames [type, body]) ----------------------------------

@message
class ConsumerRank(Message):
    """One decode rank's landing zone for a write."""
    tp_rank: int
    segment: str
    head_start: int
    head_end: int
    region_addrs: tuple[int, ...] = ()


@message
class WriteRequest(Message):
    request_id: str
    transfer_id: str
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    ranks: tuple[ConsumerRank, ...]
    notify_host: str
    notify_port: int
    write_nonce: int


@message
class WriteDone(Message):
    request_id: str
    transfer_id: str
    pp_rank: int
    tp_rank: int
    write_nonce: int
    ok: bool
    error: str = ""


@message
class Release(Message):
    transfer_id: str
    tp_rank: int
    auth: str = ""        # with a worker token: HMAC of the release (workers/kv/sidechannel.py)


SIDE_MESSAGES: dict[str, type[Message]] = {
    "write_request": WriteRequest,
    "write_done": WriteDone,
    "release": Release,
}
_SIDE_NAMES = {cls: name for name, cls in SIDE_MESSAGES.items()}


def encode_frame(msg: Message) -> bytes:
    """A side-channel message as one msgpack frame `[type, body]`."""
    out: bytes = msgpack.packb([_SIDE_NAMES[type(msg)], msg.encode()])
    return out


def decode_frame(frame: bytes) -> Message:
    try:
        kind, body = msgpack.unpackb(frame)
    except Exception as e:  # noqa: BLE001 - any malformed frame is a protocol error
        raise ProtocolError(f"side channel: undecodable frame ({e.__class__.__name__})") from None
    cls = SIDE_MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError("side channel: unknown message type", param="type")
    try:
        return cls.decode(body, kind)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - a body of the wrong shape
        raise ProtocolError(f"side channel: bad {kind} ({e.__class__.__name__})") from None


# -- section 7: holder HTTP API ---------------------------------------------------------------

@message
class HeldTransfer(Message):
    transfer_id: str
    blocks: int
    age_s: float
    request_id: str = ""
    mesh_id: str = ""


@message
class FreedTransfer(Message):
    """A transfer the holder freed recently, and by which path (consumer / mesh-reclaim / ttl)."""
    transfer_id: str
    path: str
    held_s: float
    seq: int
    request_id: str = ""


@message
class HeldList(Message):
    """`GET /kv/held?since=SEQ` on a prefill pipeline: what it holds, and what it freed after SEQ."""
    transfers: tuple[HeldTransfer, ...]
    freed: tuple[FreedTransfer, ...] = ()
    seq: int = 0    # the newest freed record's seq: pass it as `since` next time


@message
class ReleaseCommand(Message):
    """`POST /kv/release` on a prefill pipeline (idempotent)."""
    transfer_id: str
    reason: str = "mesh-reclaim"


@message
class ReleaseResult(Message):
    transfer_id: str
    released: bool


@message
class LoadReport(Message):
    """`GET /load` on any worker."""
    in_flight: int
    queued: int = 0
    held_transfers: int = 0
    free_blocks: int = 0
    num_blocks: int = 0
    draining: bool = False
    capabilities: tuple[str, ...] = ()     # section 8: what the worker serves beyond OpenAI
    # the block census (None: not reported): free + held + running == num_blocks on a worker that
    # accounts for every block; the mesh raises its leak alarm when they differ for too long
    held_blocks: int | None = None         # owned by held transfers (listable, releasable, expirable)
    running_blocks: int | None = None      # owned by running/waiting sequences and pulls in progress
