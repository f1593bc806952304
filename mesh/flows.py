"""PD flows: one per dialect, each declaring its steps (docs/design.md item 14, docs/protocol.md sections 4-5, 9).

A `Flow` says what differs between the engines behind the mesh; the orchestration loop that runs
it (pick a pair -> prefill -> hand-off -> decode -> relay -> settle, one re-pair loop for failures
before the client's first byte) is written once, in `mesh.proxy`.

- `prefill_body`: the prefill leg's body.
- `handoff`: the prefill's answer -> the decode leg's body, the transfer's ledger key and size,
  and whether the mesh sends token 0 early.
- `tracked`: whether the ledger follows the transfer (only through the holder API, section 7).
- `drain_body`: how an orphaned transfer is freed on an engine without a release API (a decode leg
  of one token on the same params, whose consumer-driven release frees the producer), or None.
- `retry_decode`: whether a decode that failed before its first byte may go to another engine with
  the same params (else the request is re-paired with a new prefill).
- `fanout`: list prompts and `n` > 1 are split into one PD pair per (prompt, choice) and merged
  back (`mesh.fanout`); otherwise they go to the engines as they came (`batch`).
- `rendezvous`: the hand-off needs the prefill's bootstrap answer (`Bootstrap`, read and cached by
  `mesh.upstream`), given to `handoff` and `drain_body` as `ctx`.
- `drain_on(err)`: whether a decode leg that ended with `err` (None: never sent) leaves the
  transfer unread, so that a drain is due (and safe: a drain on a spent transfer can wait long).

Pure: no I/O here.

Size: four dialects, one `Flow` class each, side by side so their differences read as a table.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import orjson

from contract.dialects import ATOM, DEFAULT_BOOTSTRAP_PORT, SGLANG, VLLM, VLLM_MOONCAKE, one_token
from contract.errors import InvalidRequest, ProtocolError, UpstreamClientError, UpstreamError
from contract.protocol import FIRST_TOKEN_EARLY, HOLDER_API, KVRequestParams, PrefillRecord
from contract.snapshot import Worker
from mesh.request import ClientRequest


class Entropy:
    """Random ids (SGLang's bootstrap rooms, vLLM's transfer ids) from the OS's CSPRNG, read 4 kB
    at a time: `secrets.randbits` asks the kernel (a getrandom call) for every id, ~5% of the
    mesh's CPU per SGLang request (py-spy). The buffer is dropped in a forked child, so two
    processes never hand out the same bytes."""
    __slots__ = ("_buf", "_at")
    SIZE = 4096

    def __init__(self) -> None:
        self._buf = b""
        self._at = 0
        os.register_at_fork(after_in_child=self._drop)

    def _drop(self) -> None:
        self._buf, self._at = b"", 0

    def take(self, n: int) -> bytes:
        at = self._at
        if at + n > len(self._buf):
            self._buf, at = os.urandom(max(self.SIZE, n)), 0
        self._at = at + n
        return self._buf[at:at + n]

    def bits63(self) -> int:
        return int.from_bytes(self.take(8), "big") >> 1

    def hex(self, nbytes: int) -> str:
        return self.take(nbytes).hex()


ENTROPY = Entropy()


@dataclass(frozen=True, slots=True)
class Handoff:
    decode_body: dict[str, Any]
    params: dict[str, Any]          # the decode's kv_transfer_params
    key: str = ""                   # the transfer's ledger key, str(transfer_id); "" when none
    blocks: int = 0
    first_token_id: int | None = None
    early: bool = False             # the mesh sends the role chunk and token 0 before the decode leg
    lifted: RawBlockIds | None = None   # the block ids went on as the prefill's bytes


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """A vLLM Mooncake prefill's bootstrap server and what its `GET /query` said: engine id per DP rank."""
    addr: str
    engine_ids: dict[int, str]


def _scalar(v: Any) -> bool:
    return v is not None and not isinstance(v, (dict, list))


def _int(v: Any) -> bool:
    return type(v) is int


def _ints(xs: list[Any]) -> bool:
    """Every item an integer, at C speed: JSON gives ints, floats, strings, null, arrays, objects;
    summing raises on the last four and turns float. A 1 MB prompt's 62,500 block ids in ~0.3 ms,
    a quarter of collecting their types. Booleans (ints to Python) pass here: the decode's own
    check of the hand-off (contract.protocol) refuses them."""
    try:
        return type(sum(xs)) is int
    except TypeError:
        return False


@dataclass(frozen=True, slots=True)
class RawBlockIds:
    """A prefill answer's `remote_block_ids`, kept as the JSON bytes it came in and forwarded to
    the decode verbatim (`json`, an `orjson.Fragment`): a long prompt's tens of thousands of ids
    are never made into Python ints, checked one by one, encoded again and freed
    (bench/overhead.py --prompt-bytes)."""
    raw: bytes
    count: int
    json: orjson.Fragment

    def valid(self) -> bool:
        """The whole JSON check (what `lift_block_ids` leaves to the decode's parser)."""
        try:
            xs = orjson.loads(self.raw)
        except orjson.JSONDecodeError:
            return False
        return isinstance(xs, list) and _ints(xs) and len(xs) == self.count


_IDS_KEY = b'"remote_block_ids":'


def lift_block_ids(data: bytes) -> tuple[bytes, RawBlockIds | None]:
    """`data` (a prefill's JSON answer) with its one `"remote_block_ids":[...]` array replaced by
    `0`, and that array; or `data` unchanged and None where the key is not there once or its array
    is not compact digits and commas (the caller then parses `data` whole, as before). The key
    inside a JSON string would read `\\"remote_block_ids\\"`: no match. Checked here at memory speed:
    one key, the brackets, nothing but digits and commas, no comma first or last. Not checked here
    (two-byte searches cost as much as the parse saved): an empty element (`1,,2`) or a leading
    zero (`01`); such an array makes the decode leg's body invalid JSON, which the decode refuses
    before it touches KV, and the mesh then blames the prefill (`RawBlockIds.valid`, in
    `mesh.proxy`), as the whole parse would have."""
    i = data.find(_IDS_KEY)
    if i < 0:
        return data, None
    s = i + len(_IDS_KEY)
    if data[s:s + 1] != b"[":
        return data, None
    e = data.find(b"]", s)
    if e < 0 or data.find(_IDS_KEY, e) >= 0:   # (between i and e: only digits and commas, checked below)
        return data, None
    inner = data[s + 1:e]
    commas = inner.translate(None, b"0123456789")   # the separators, and anything that is no digit
    if inner and (commas.translate(None, b",") or inner[:1] == b"," or inner[-1:] == b","):
        return data, None
    raw = data[s:e + 1]
    return data[:s] + b"0" + data[e + 1:], RawBlockIds(raw, len(commas) + 1 if inner else 0, orjson.Fragment(raw))


def place_block_ids(answer: dict[str, Any], ids: RawBlockIds) -> bool:
    """Put the lifted array back where it was taken from; False when the placeholder is not at
    `kv_transfer_params.remote_block_ids` (the key stood elsewhere: parse the answer whole)."""
    kvp = answer.get("kv_transfer_params")
    if not isinstance(kvp, dict) or kvp.get("remote_block_ids", None) != 0 or type(kvp["remote_block_ids"]) is not int:
        return False
    kvp["remote_block_ids"] = ids
    return True


def _registered_stages(raw: dict[str, Any], pw: Worker) -> None:
    """The stage addresses a prefill names (where the decode will connect and send its ranks'
    segments) must be the pipeline's own, as its record says: a decode pulls only from registered
    stages (issue 16). Stages the record does not place (kv_port 0: an engine enrolled without
    --stage) are not checked."""
    rec = pw.record
    known = {(s.pp_rank, s.host, s.kv_port) for s in rec.stages if s.kv_port} if isinstance(rec, PrefillRecord) else set()
    if not known:
        return
    named = []
    stages = raw.get("stages")
    if stages is not None:
        if not isinstance(stages, list):
            raise ProtocolError("kv_transfer_params.stages must be an array", param="kv_transfer_params.stages")
        named += [(s.get("pp_rank"), s.get("host"), s.get("port")) if isinstance(s, dict) else (None, None, s)
                  for s in stages]
    # this project's workers: stage 0 is also remote_host:remote_port (an ATOM prefill's remote_port
    # moves with its DP rank, port_offset: not a registered address)
    if pw.has(HOLDER_API) and any(r == 0 for r, _, _ in known):
        named.append((0, raw.get("remote_host"), raw.get("remote_port")))
    for r, host, port in named:
        if (r, host, port) not in known:
            raise ProtocolError(f"kv_transfer_params names stage {r} at {host}:{port}, which is not a registered "
                                f"stage of pipeline {pw.id}", param="kv_transfer_params.stages")


class Flow:
    dialect = ""
    lift_block_ids = False   # the prefill's block ids forwarded as JSON bytes (`RawBlockIds`)
    concurrent = False    # both legs at once, meeting on a rendezvous (SGLang)
    retry_decode = True
    fanout = True
    drains = False        # an untracked orphan is freed by a drain leg (`drain_body`)
    drop: tuple[str, ...] = ()   # client fields kept off the prefill leg
    rendezvous = False    # the hand-off needs the prefill's bootstrap answer (vllm-mooncake)

    def tracked(self, pipeline: Worker) -> bool:
        return False

    def prefill_body(self, creq: ClientRequest, pw: Worker, dw: Worker, mesh_id: str) -> dict[str, Any]:
        raise NotImplementedError

    def handoff(self, creq: ClientRequest, pw: Worker, dw: Worker, answer: dict[str, Any],
                early_ok: bool, sent: dict[str, Any] | None = None, ctx: Bootstrap | None = None) -> Handoff:
        raise NotImplementedError

    def drain_body(self, creq: ClientRequest, h: Handoff, ctx: Bootstrap | None = None) -> dict[str, Any] | None:
        return None

    def drain_on(self, err: BaseException | None) -> bool:
        return True

    def check(self, creq: ClientRequest) -> None:
        """Refuse what this flow cannot serve (a clear 400), before any leg is sent."""

    def _one_token(self, body: dict[str, Any]) -> dict[str, Any]:
        out = one_token(body)
        for k in self.drop:
            out.pop(k, None)
        return out


class AtomFlow(Flow):
    """This project's workers and ATOM (ROCm/ATOM): prefill first; the decode gets every field of
    the prefill's params plus ATOM's router enrichment (`remote_dp_rank`, `remote_dp_size`,
    `remote_tp_size`: atom/mesh `core/placement/backend/atom.rs` `enrich_decode_kv`). Only a decode
    declaring `first_token_early` gets token 0 early (ATOM's decode injects and emits T0 itself).
    Transfers are tracked where the prefill has the holder API; elsewhere (ATOM frees a transfer
    only once a consumer pulled it) an orphan is drained by a one-token decode leg."""

    dialect = ATOM
    drains = True
    lift_block_ids = True

    def tracked(self, pipeline: Worker) -> bool:
        return pipeline.has(HOLDER_API)

    def prefill_body(self, creq: ClientRequest, pw: Worker, dw: Worker, mesh_id: str) -> dict[str, Any]:
        out = self._one_token(creq.body)
        rec = dw.record
        extra = {"mesh_id": mesh_id} if pw.has(HOLDER_API) else {}
        out["kv_transfer_params"] = KVRequestParams(
            remote_engine_id=dw.id, remote_host=dw.host, remote_port=dw.port,
            remote_handshake_port=int(rec.extra.get("kv_port", 0)), remote_tp_size=rec.tp_size,
            extra=extra).encode()
        return _stop_as_list(out)

    def handoff(self, creq: ClientRequest, pw: Worker, dw: Worker, answer: dict[str, Any],
                early_ok: bool, sent: dict[str, Any] | None = None, ctx: Bootstrap | None = None) -> Handoff:
        raw = answer.get("kv_transfer_params")
        if not isinstance(raw, dict):
            raise ProtocolError("the prefill answer has no kv_transfer_params object", param="kv_transfer_params")
        tid = raw.get("transfer_id")
        if not _scalar(tid):
            raise ProtocolError(f"kv_transfer_params.transfer_id must be a JSON scalar, got {tid!r}",
                                param="kv_transfer_params.transfer_id")
        ids = raw.get("remote_block_ids")
        if isinstance(ids, RawBlockIds):   # checked as it was lifted
            n_blocks = ids.count
        elif isinstance(ids, list) and _ints(ids):
            n_blocks = len(ids)
        else:
            raise ProtocolError("kv_transfer_params.remote_block_ids must be an array of integers",
                                param="kv_transfer_params.remote_block_ids")
        ft = raw.get("first_token_id")
        if ft is not None and not _int(ft):
            raise ProtocolError("kv_transfer_params.first_token_id must be an integer or null",
                                param="kv_transfer_params.first_token_id")
        _registered_stages(raw, pw)
        params = dict(raw)   # every field of the prefill, types unchanged
        if isinstance(ids, RawBlockIds):
            params["remote_block_ids"] = ids.json
        params["do_remote_prefill"] = True
        params["do_remote_decode"] = False
        # ATOM router `enrich_decode_kv`: what the decode's ReqMeta needs and the prefill omits
        tp = raw.get("tp_size")
        params.setdefault("remote_tp_size", tp if _int(tp) else pw.record.tp_size)
        params.setdefault("remote_dp_size", getattr(pw.record, "dp_size", 1))
        if _int(raw.get("dp_rank")):
            params.setdefault("remote_dp_rank", raw["dp_rank"])
        early = False
        if dw.has(FIRST_TOKEN_EARLY):
            # this project's additions: the answer's id and created (the same bytes however the
            # stream is sent) and, with first token early, that the role chunk and T0 are out
            params["response_meta"] = {"id": ("chatcmpl-" if creq.kind == "chat" else "cmpl-") + creq.request_id,
                                       "created": int(time.time())}
            early = early_ok and creq.stream and ft is not None
            if early:
                params["first_token_early"] = True
        body = _stop_as_list(dict(creq.body))
        body["kv_transfer_params"] = params
        return Handoff(body, params, str(tid), n_blocks, ft, early,
                       ids if isinstance(ids, RawBlockIds) else None)

    def drain_body(self, creq: ClientRequest, h: Handoff, ctx: Bootstrap | None = None) -> dict[str, Any] | None:
        out = _stop_as_list(self._one_token(creq.body))
        out["kv_transfer_params"] = {k: v for k, v in h.params.items()
                                     if k not in ("response_meta", "first_token_early")}
        return out


class VllmFlow(Flow):
    """vLLM with the NIXL connector (vllm `distributed/kv_transfer/kv_connector/v1/nixl_connector.py`,
    `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`): prefill first with null remote
    fields; the decode gets the prefill's params verbatim and writes every token itself. vLLM frees
    the prefill's blocks on the decode's read, on a decode abort, or when its lease lapses, so a
    failed decode is never retried on the same params, and nothing is drained. The block ids go on
    as the prefill's bytes where they are compact (`lift_block_ids`; vLLM's API server answers
    compact JSON): a 220 kB prompt's ids cost the mesh 0.3 ms parsed and encoded again
    (bench/overhead.py --anchors --prompt-bytes)."""

    dialect = VLLM
    retry_decode = False
    lift_block_ids = True
    drop = ("min_tokens", "min_completion_tokens")

    def prefill_body(self, creq: ClientRequest, pw: Worker, dw: Worker, mesh_id: str) -> dict[str, Any]:
        out = self._one_token(creq.body)
        out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
        return out

    def handoff(self, creq: ClientRequest, pw: Worker, dw: Worker, answer: dict[str, Any],
                early_ok: bool, sent: dict[str, Any] | None = None, ctx: Bootstrap | None = None) -> Handoff:
        raw = answer.get("kv_transfer_params")
        if not isinstance(raw, dict):
            raise ProtocolError("the prefill answer has no kv_transfer_params object", param="kv_transfer_params")
        if not raw.get("do_remote_prefill"):
            raise ProtocolError("kv_transfer_params.do_remote_prefill is not true", param="kv_transfer_params")
        for k in ("remote_engine_id", "remote_block_ids"):
            if raw.get(k) is None:
                raise ProtocolError(f"kv_transfer_params.{k} is missing", param=f"kv_transfer_params.{k}")
        ids = raw["remote_block_ids"]
        lifted = ids if isinstance(ids, RawBlockIds) else None
        if lifted is not None:   # verbatim still: the prefill's own bytes
            raw = dict(raw)
            raw["remote_block_ids"] = lifted.json
        body = dict(creq.body)
        body["kv_transfer_params"] = raw
        return Handoff(body, raw, lifted=lifted)


class VllmMooncakeFlow(Flow):
    """vLLM with its MooncakeConnector (vllm 0.32 `distributed/kv_transfer/kv_connector/v1/mooncake/
    mooncake_connector.py`; the router side as ROCm/ATOM `atom/mesh/src/core/placement/backend/
    vllm.rs` drives it): a router-minted `transfer_id` on both legs; the decode also gets
    `remote_bootstrap_addr` and `remote_engine_id` (the prefill's `GET {bootstrap}/query` answer for
    its DP rank). The reference proxies send both legs at once; the connector also serves the prefill
    first (its producer keeps a finished request's blocks for `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`,
    480 s, until a consumer pulls them), and the mesh does so: sent at once, a decode whose prefill
    failed waits up to 480 s on the producer and keeps its blocks that long (measured on vLLM 0.32
    CPU), while prefill-first sends no decode for a failed prefill. The prefill answers no params.
    A transfer is unread when its decode leg was never sent, refused (4xx), failed to connect, or
    answered 5xx (a pull that failed, e.g. on a stale engine id): then a one-token decode leg with a
    freshly read engine id drains it. A decode that was cut or timed out may still be pulling, and
    vLLM frees the producer when it aborts, so it is left alone (a drain on a spent transfer would
    wait on the producer for 480 s)."""

    dialect = VLLM_MOONCAKE
    retry_decode = False
    drains = True
    rendezvous = True
    drop = ("min_tokens", "min_completion_tokens")

    def prefill_body(self, creq: ClientRequest, pw: Worker, dw: Worker, mesh_id: str) -> dict[str, Any]:
        out = self._one_token(creq.body)
        out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                     "transfer_id": f"xfer-{ENTROPY.hex(16)}"}
        return out

    def handoff(self, creq: ClientRequest, pw: Worker, dw: Worker, answer: dict[str, Any],
                early_ok: bool, sent: dict[str, Any] | None = None, ctx: Bootstrap | None = None) -> Handoff:
        assert sent is not None and ctx is not None, "the proxy gives a rendezvous flow its prefill body and ctx"
        tid = sent["kv_transfer_params"]["transfer_id"]
        params = {"do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": ctx.addr,
                  "remote_engine_id": engine_id(ctx, pw), "transfer_id": tid}
        body = dict(creq.body)
        body["kv_transfer_params"] = params
        return Handoff(body, params, tid)

    def drain_body(self, creq: ClientRequest, h: Handoff, ctx: Bootstrap | None = None) -> dict[str, Any] | None:
        out = self._one_token(creq.body)
        params = dict(h.params)
        if ctx is not None:  # the engine id read again: a stale one is why a decode may have failed
            params["remote_engine_id"] = engine_id(ctx, None, params["remote_engine_id"])
        out["kv_transfer_params"] = params
        return out

    def drain_on(self, err: BaseException | None) -> bool:
        if err is None or isinstance(err, UpstreamClientError):
            return True
        return isinstance(err, UpstreamError) and not err.may_hold_kv  # no connection, or a 5xx answer


def bootstrap_addr(pw: Worker) -> str:
    """`http://host:port` of a prefill's bootstrap server (record `bootstrap_host`/`bootstrap_port`)."""
    extra = pw.record.extra
    host = bracket_host(str(extra.get("bootstrap_host") or pw.host))
    return f"http://{host}:{int(extra.get('bootstrap_port', DEFAULT_BOOTSTRAP_PORT))}"


def engine_id(ctx: Bootstrap, pw: Worker | None, default: str | None = None) -> str:
    """The engine id of the prefill's DP rank (record `dp_rank`, default 0) in its bootstrap answer."""
    rank = int(pw.record.extra.get("dp_rank", 0)) if pw is not None else min(ctx.engine_ids)
    eid = ctx.engine_ids.get(rank, default)
    if eid is None:
        raise ProtocolError(f"bootstrap {ctx.addr}/query names no engine for dp_rank {rank}", param="dp_rank")
    return eid


def parse_bootstrap(addr: str, data: Any) -> Bootstrap:
    """Validate a `GET /query` answer (vllm `mooncake_utils.py` MooncakeBootstrapServer.query:
    `{"<dp_rank>": {"engine_id": str, "worker_addr": {...}}}`)."""
    if not isinstance(data, dict) or not data:
        raise ProtocolError(f"bootstrap {addr}/query answered no engines")
    out: dict[int, str] = {}
    for rank, entry in data.items():
        eid = entry.get("engine_id") if isinstance(entry, dict) else None
        if not (isinstance(rank, str) and rank.isdigit()) or not isinstance(eid, str) or not eid:
            raise ProtocolError(f"bootstrap {addr}/query: bad entry for dp_rank {rank!r}")
        out[int(rank)] = eid
    return Bootstrap(addr, out)


class SglangFlow(Flow):
    """SGLang (sgl-project/sglang `python/sglang/srt/disaggregation/mini_lb.py`, the model gateway's
    PD router): the same `bootstrap_host/port/room` on both legs, sent at once; batches (a list
    prompt, chat `n` > 1) carry lists of rooms. The decode builds `http://{host}:{port}/route`
    (`disaggregation/decode.py`, `common/conn.py`), so an IPv6 host goes in brackets."""

    dialect = SGLANG
    concurrent = True
    retry_decode = False
    fanout = False

    def check(self, creq: ClientRequest) -> None:
        if creq.kind == "completions" and (creq.body.get("n") or 1) > 1:
            raise InvalidRequest("n: values above 1 are not served on /v1/completions by SGLang PD pipelines "
                                 "(the gateway gives rooms per prompt, not per choice); send n separate requests",
                                 param="n")

    def bodies(self, creq: ClientRequest, pw: Worker) -> tuple[dict[str, Any], dict[str, Any]]:
        """(prefill body, decode body): the client's body plus the same bootstrap fields; the prefill
        leg is not streamed (its answer only says the prefill finished)."""
        extra = pw.record.extra
        port = int(extra.get("bootstrap_port", DEFAULT_BOOTSTRAP_PORT))
        host = bracket_host(str(extra.get("bootstrap_host") or pw.host))
        n = batch_size(creq)
        if n is None:
            boot: dict[str, Any] = {"bootstrap_host": host, "bootstrap_port": port,
                                    "bootstrap_room": ENTROPY.bits63()}
        else:
            boot = {"bootstrap_host": [host] * n, "bootstrap_port": [port] * n,
                    "bootstrap_room": [ENTROPY.bits63() for _ in range(n)]}
        dec = {**creq.body, **boot}
        pre = {**creq.body, **boot, "stream": False}
        pre.pop("stream_options", None)
        return pre, dec


def batch_size(creq: ClientRequest) -> int | None:
    """SGLang's batch size of a request (sgl-model-gateway `get_*_batch_size`): a list of prompts, or
    chat `n` > 1; None for a single request."""
    if creq.kind == "chat":
        n = creq.body.get("n") or 1
        return n if n > 1 else None
    p = creq.body.get("prompt")
    if isinstance(p, list) and p and not isinstance(p[0], int):
        return len(p)
    return None


def bracket_host(host: str) -> str:
    """An IPv6 literal in brackets, as it must appear in `http://{host}:{port}`."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _stop_as_list(body: dict[str, Any]) -> dict[str, Any]:
    """`stop` as an array: ATOM's request model declares `stop: list[str] | None` (a string is a
    422 there); the same meaning for every OpenAI engine."""
    if isinstance(body.get("stop"), str):
        body["stop"] = [body["stop"]]
    return body


FLOWS: dict[str, Flow] = {f.dialect: f for f in (AtomFlow(), VllmFlow(), SglangFlow(), VllmMooncakeFlow())}
