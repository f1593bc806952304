"""PD dialects: what the mesh sends to each leg, per the engines behind it.

A dialect is chosen per registered worker (`mesh register --dialect`, the record's `dialect`)
and a prefill pipeline is paired only with decode engines of its own dialect.

- `atom` (native, docs/protocol.md sections 4-5): prefill first with the decode's address in
  `kv_transfer_params`; the prefill's answer params go verbatim to the decode; the KV is
  tracked by the mesh's ledger and released by the consumer (or reclaimed by the mesh).
- `vllm` (vLLM's NIXL connector, as its disaggregated proxy drives it):
  prefill first with `kv_transfer_params = {do_remote_decode: true, ...nulls}`, `max_tokens=1`,
  no stream; the decode gets the client's body with the prefill's returned `kv_transfer_params`
  (`do_remote_prefill`, `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`, ...)
  verbatim. The decode engine computes every output token itself; the prefill engine frees its
  blocks when they were read, or after its own abort timeout (engine-managed KV).
- `sglang` (SGLang's PD load balancer): `bootstrap_host`, `bootstrap_port` (the prefill's
  bootstrap server) and a random `bootstrap_room` added to the client's body, sent to the
  prefill and the decode at once; the decode's answer is the client's (streamed or not). The
  engines rendezvous on the room and free the KV themselves (engine-managed KV).
- `vllm-mooncake` (vLLM's MooncakeConnector, as ATOM's router and vLLM's Mooncake proxy drive it):
  a `transfer_id` minted by the mesh on both legs; the decode also gets the prefill's bootstrap
  address and its engine id, read from the prefill's bootstrap server (`GET /query`).

The per-dialect steps are the gateway's flows (one `Flow` each); this module holds the names.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from contract.errors import ProtocolError


class Dialect(StrEnum):
    """The PD dialects (a `str`: records, TOML and flags carry the plain name)."""
    ATOM = "atom"
    VLLM = "vllm"
    SGLANG = "sglang"
    VLLM_MOONCAKE = "vllm-mooncake"


ATOM, VLLM, SGLANG, VLLM_MOONCAKE = Dialect.ATOM, Dialect.VLLM, Dialect.SGLANG, Dialect.VLLM_MOONCAKE
DIALECTS: tuple[str, ...] = tuple(d.value for d in Dialect)
# SGLang's default --disaggregation-bootstrap-port and vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT
DEFAULT_BOOTSTRAP_PORT = 8998


def check_dialect(value: Any, where: str = "dialect") -> Dialect:
    if not isinstance(value, str) or value not in DIALECTS:
        raise ProtocolError(f"{where}: unknown dialect {value!r}; one of {', '.join(DIALECTS)}", param=where)
    return Dialect(value)


def one_token(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: the client's, not streamed, one token."""
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out
