"""Rank control frames: typed msgpack, never pickle (a frame from the network runs no code).

Rank 0 and its ranks (spawned here, or remote `mesh stage` processes) exchange lists whose first
item names the command; every command has a declared shape, checked on decode, and anything else is
a `ProtocolError`. Tensors travel as a msgpack extension: a declared dtype and shape, then the raw
bytes (their length must match). Before any command, both ends prove they hold the pipeline's
secret (`handshake_*`): HMAC-SHA256 over fresh nonces, each way, so neither a fake stage nor a fake
head gets past the first frame.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import os
import struct
from typing import Any

import msgpack
import torch

from contract.errors import ConfigError, ProtocolError
from workers.engine.config import EngineConfig, Parallel
from workers.engine.model import ForwardBatch, SeqSlice

TENSOR_EXT = 1
MAX_DIMS = 8
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
           "bool": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}
SECRET_ENV = "ATOMESH_PIPELINE_SECRET"


# -- tensors ------------------------------------------------------------------------------------

def _tensor_ext(t: torch.Tensor) -> msgpack.ExtType:
    t = t.detach().contiguous().cpu()
    if t.dtype not in _NAMES:
        raise ProtocolError(f"a {t.dtype} tensor cannot travel")
    head = msgpack.packb([_NAMES[t.dtype], list(t.shape)])
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return msgpack.ExtType(TENSOR_EXT, struct.pack("<I", len(head)) + head + data)


def _ext_hook(code: int, data: bytes) -> Any:
    if code != TENSOR_EXT or len(data) < 4:
        raise ProtocolError(f"unknown extension {code}")
    (n,) = struct.unpack_from("<I", data)
    if n > len(data) - 4:
        raise ProtocolError("tensor header past the frame")
    head = msgpack.unpackb(data[4:4 + n], raw=False)
    if not (isinstance(head, list) and len(head) == 2 and head[0] in _DTYPES and isinstance(head[1], list)
            and len(head[1]) <= MAX_DIMS and all(type(d) is int and 0 <= d < 2 ** 40 for d in head[1])):
        raise ProtocolError("bad tensor header")
    dtype, shape = _DTYPES[head[0]], head[1]
    raw = data[4 + n:]
    if len(raw) != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
        raise ProtocolError("tensor bytes do not match its shape")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _default(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return _tensor_ext(o)
    raise ProtocolError(f"a {type(o).__name__} cannot travel on rank control")


def pack(*msg: Any) -> bytes:
    return msgpack.packb(list(msg), default=_default, use_bin_type=True)


# -- declared shapes ------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return type(v) is int


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def _t(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def _scalar_map(v: Any) -> bool:
    """An info / config map: str keys; ints, strs, bools, None, or lists of ints."""
    return isinstance(v, dict) and all(isinstance(k, str) and (v[k] is None or type(v[k]) in (int, str, bool, float)
                                                               or _ints(v[k]) or _strs(v[k])) for k in v)


def _strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


COMMANDS: dict[str, Any] = {
    "hello": lambda a: len(a) == 2 and _is_int(a[0]) and isinstance(a[1], bytes) and len(a[1]) == 32,
    "challenge": lambda a: len(a) == 2 and isinstance(a[0], bytes) and len(a[0]) == 32 and isinstance(a[1], bytes),
    "auth": lambda a: len(a) == 1 and isinstance(a[0], bytes),
    "spec": lambda a: len(a) == 1 and isinstance(a[0], dict),
    "ready": lambda a: len(a) == 2 and _is_int(a[0]) and _scalar_map(a[1]),
    "error": lambda a: len(a) == 1 and isinstance(a[0], str),
    "stop": lambda a: not a,
    "ping": lambda a: not a,
    "pong": lambda a: not a,
    "ok": lambda a: not a,
    "enroll": lambda a: (len(a) == 4 and _scalar_map(a[0]) and isinstance(a[1], str) and isinstance(a[2], dict)
                         and _is_int(a[3])),
    "forward": lambda a: (len(a) == 2 and isinstance(a[0], list) and len(a[0]) == 3 and isinstance(a[0][0], list)
                          and all(isinstance(s, list) and len(s) == 4 and _is_int(s[0]) and _is_int(s[1])
                                  and _t(s[2]) and type(s[3]) is bool for s in a[0][0])
                          and _t(a[0][1]) and _t(a[0][2]) and (a[1] is None or _t(a[1]))),
    "write_kv": lambda a: len(a) == 3 and _is_int(a[0]) and _ints(a[1]) and _t(a[2]),
    "read_kv": lambda a: len(a) == 2 and _is_int(a[0]) and _ints(a[1]),
    "tensor": lambda a: len(a) == 1 and _t(a[0]),
}


def unpack(frame: bytes, expect: tuple[str, ...] | None = None) -> tuple[str, list[Any]]:
    """(command, arguments) of a frame, checked against the command's declared shape."""
    try:
        msg = msgpack.unpackb(frame, raw=False, ext_hook=_ext_hook, strict_map_key=True,
                              max_bin_len=1 << 34, max_array_len=1 << 24, max_map_len=64)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed msgpack
        raise ProtocolError(f"rank control frame is not valid msgpack: {e.__class__.__name__}") from None
    if not (isinstance(msg, list) and msg and isinstance(msg[0], str) and msg[0] in COMMANDS):
        raise ProtocolError("rank control frame names no known command")
    cmd, args = msg[0], msg[1:]
    if expect is not None and cmd not in expect:
        raise ProtocolError(f"rank control: {cmd!r} where {' or '.join(expect)} was due")
    if not COMMANDS[cmd](args):
        raise ProtocolError(f"rank control: {cmd!r} with arguments of the wrong shape")
    return cmd, args


# -- typed payloads ----------------------------------------------------------------------------------

def batch_out(batch: ForwardBatch) -> list[Any]:
    return [[[s.start, s.n, s.block_table, s.want_logits] for s in batch.slices], batch.positions, batch.slots]


def batch_in(v: list[Any]) -> ForwardBatch:
    return ForwardBatch([SeqSlice(a, b, t, w) for a, b, t, w in v[0]], v[1], v[2])


def _dc(cls: Any, d: Any, where: str) -> Any:
    """A dataclass from a map: only its fields, each of the declared scalar type."""
    if not isinstance(d, dict):
        raise ProtocolError(f"{where} must be a map")
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            v = d[f.name]
            want = {"int": int, "str": str, "bool": bool, "float": float}.get(str(f.type).split(" ")[0])
            if v is not None and want is not None and not (type(v) is want or (want is float and type(v) is int)):
                raise ProtocolError(f"{where}.{f.name} must be {want.__name__}")
            out[f.name] = v
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {sorted(unknown)}")
    try:
        return cls(**out)
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"{where}: {e}") from None


def spec_out(spec: Any) -> dict[str, Any]:
    d = dataclasses.asdict(spec)
    d.pop("secret", None)   # never on the wire: each end has its own copy
    return d


def spec_in(d: dict[str, Any], cls: Any) -> Any:
    d = dict(d)
    d["engine"] = _dc(EngineConfig, d.get("engine"), "spec.engine")
    d["par"] = _dc(Parallel, d.get("par"), "spec.par")
    if d.get("kind") not in ("tp", "pp") or d.get("backend") not in ("gloo", "nccl"):
        raise ProtocolError("spec: kind must be tp or pp, backend gloo or nccl")
    for k in ("rank", "world", "store_port", "ctrl_port"):
        if type(d.get(k)) is not int or not 0 <= d[k] <= 65535:
            raise ProtocolError(f"spec.{k} must be an integer in 0..65535")
    for k in ("checkpoint", "kv_host", "head"):
        if not isinstance(d.get(k), str):
            raise ProtocolError(f"spec.{k} must be a string")
    if d.get("store_path", "") != "":   # a file path from the network: never (remote stages use TCP)
        raise ProtocolError("spec.store_path must be empty for a remote stage")
    if d.get("kv_backend") not in (None, "mooncake", "zmq", "cuda-ipc") or type(d.get("producer")) is not bool:
        raise ProtocolError("spec: kv_backend must be mooncake, zmq or null; producer a boolean")
    names = {f.name for f in dataclasses.fields(cls)}
    if set(d) - names:
        raise ProtocolError(f"spec: unknown field(s) {sorted(set(d) - names)}")
    return cls(**d)


# -- the handshake -----------------------------------------------------------------------------------

def pipeline_secret(required: bool) -> bytes | None:
    """The pipeline's shared secret (ATOMESH_PIPELINE_SECRET, at least 16 characters): what a head
    and its remote stages prove to each other; from a k8s Secret in deploy/k8s."""
    s = os.environ.get(SECRET_ENV, "")
    if not s:
        if required:
            raise ConfigError(f"remote stages need a pipeline secret: set {SECRET_ENV} (the same on the head "
                              "and every stage, at least 16 characters)")
        return None
    if len(s) < 16:
        raise ConfigError(f"{SECRET_ENV} must be at least 16 characters")
    return s.encode()


def mac(secret: bytes, role: bytes, rank: int, nonce: bytes) -> bytes:
    return hmac.new(secret, role + b"|" + str(rank).encode() + b"|" + nonce, hashlib.sha256).digest()


def kv_grant(secret: bytes, transfer_id: str, blocks: tuple[int, ...] | list[int]) -> str:
    """Stage 0's word to the pipeline's other stages (and a TP prefill's other ranks) that it holds
    `transfer_id` on exactly these blocks: they serve a write request only with it."""
    msg = b"kv|" + transfer_id.encode() + b"|" + ",".join(map(str, blocks)).encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def nonce() -> bytes:
    return os.urandom(32)


def check_mac(secret: bytes, role: bytes, rank: int, nonce_: bytes, got: bytes) -> bool:
    return hmac.compare_digest(mac(secret, role, rank, nonce_), got)
