"""PD dialects: what the mesh sends to each leg, per the engines behind it.

A dialect is chosen per registered worker (`mesh register --dialect`, the record's `dialect`)
and a prefill pipeline is paired only with decode engines of its own dialect.

- `atom` (native, PROTOCOL.md sections 4-5): prefill first with the decode's address in
  `kv_transfer_params`; the prefill's answer params go verbatim to the decode; the KV is
  tracked by the mesh's ledger and released by the consumer (or reclaimed by the mesh).
- `vllm` (vLLM's NIXL and Mooncake connectors, as their disaggregated proxy drives them):
  prefill first with `kv_transfer_params = {do_remote_decode: true, ...nulls}`, `max_tokens=1`,
  no stream; the decode gets the client's body with the prefill's returned `kv_transfer_params`
  (`do_remote_prefill`, `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`, ...)
  verbatim. The decode engine computes every output token itself; the prefill engine frees its
  blocks when they were read, or after its own abort timeout (engine-managed KV).
- `sglang` (SGLang's PD load balancer): `bootstrap_host`, `bootstrap_port` (the prefill's
  bootstrap server) and a random `bootstrap_room` added to the client's body, sent to the
  prefill and the decode at once; the decode's answer is the client's (streamed or not). The
  engines rendezvous on the room and free the KV themselves (engine-managed KV).

Pure functions only; the flows that use them live in `mesh.proxy`.
"""

from __future__ import annotations

import secrets
from typing import Any

from mesh.errors import ProtocolError
from mesh.snapshot import Worker

ATOM = "atom"
VLLM = "vllm"
SGLANG = "sglang"
DIALECTS = (ATOM, VLLM, SGLANG)
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's default --disaggregation-bootstrap-port


def check_dialect(value: Any, where: str = "dialect") -> str:
    if value not in DIALECTS:
        raise ProtocolError(f"{where}: unknown dialect {value!r}; one of {', '.join(DIALECTS)}", param=where)
    return str(value)


def one_token(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: the client's, not streamed, one token."""
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


# -- vllm -------------------------------------------------------------------------------------

def vllm_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = one_token(body)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    return out


def vllm_decode_params(raw: Any) -> dict[str, Any]:
    """The prefill answer's `kv_transfer_params`, checked for what a vLLM decode needs, verbatim."""
    if not isinstance(raw, dict):
        raise ProtocolError("the prefill answer has no kv_transfer_params object", param="kv_transfer_params")
    if not raw.get("do_remote_prefill"):
        raise ProtocolError("kv_transfer_params.do_remote_prefill is not true", param="kv_transfer_params")
    for k in ("remote_engine_id", "remote_block_ids"):
        if raw.get(k) is None:
            raise ProtocolError(f"kv_transfer_params.{k} is missing", param=f"kv_transfer_params.{k}")
    return raw


# -- sglang -----------------------------------------------------------------------------------

def sglang_bootstrap(pipeline: Worker) -> dict[str, Any]:
    """Where the decode meets the prefill: its bootstrap server and a fresh room (63 bits)."""
    extra = pipeline.record.extra
    port = extra.get("bootstrap_port", DEFAULT_BOOTSTRAP_PORT)
    host = extra.get("bootstrap_host") or pipeline.host
    return {"bootstrap_host": host, "bootstrap_port": int(port), "bootstrap_room": secrets.randbits(63)}


def sglang_bodies(body: dict[str, Any], pipeline: Worker) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill body, decode body): the client's body plus the same bootstrap fields; the prefill
    leg is not streamed (its answer only says the prefill finished)."""
    boot = sglang_bootstrap(pipeline)
    dec = {**body, **boot}
    pre = {**body, **boot, "stream": False}
    pre.pop("stream_options", None)
    return pre, dec
