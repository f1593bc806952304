"""Mesh configuration: frozen dataclasses, built by the CLI from flags and a TOML file.

A TOML file looks like::

    [mesh]
    prefill_policy = "cache_aware"
    decode_policy = "least_loaded"
    decode_retries = 1

    [[prefill]]
    id = "pipe-a"
    url = "http://10.0.0.1:8100"
    model = "llama"
    pp_size = 2

    [[decode]]
    id = "dec-a"
    url = "http://10.0.0.2:8200"
    model = "llama"
    tp_size = 2

    [[worker]]            # regular (non-PD) mode: one pool of full workers
    url = "http://10.0.0.3:8000"

Any field of the docs/protocol.md section 2 records may appear in a worker table; `model` may be
left out, and is then learnt from the worker's `GET /v1/models`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from typing import Any

from contract.errors import ConfigError
from contract.etcd import EtcdConfig
from contract.snapshot import Worker, make_worker
from mesh.admission import AdmissionConfig
from mesh.request import Limits


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect: float = 3.0          # TCP connect to a worker
    prefill: float = 120.0        # whole prefill leg
    decode_first_byte: float = 60.0  # decode leg until its first byte (KV pull included)
    decode_idle: float = 60.0     # between two chunks of the decode stream
    release: float = 5.0          # a POST /kv/release

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ConfigError(f"timeouts.{f.name} must be > 0")


@dataclass(frozen=True, slots=True)
class MeshConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    reuse_port: bool = False                   # one of `mesh serve --workers N`'s processes (SO_REUSEPORT)
    prefill: tuple[Worker, ...] = ()
    decode: tuple[Worker, ...] = ()
    workers: tuple[Worker, ...] = ()           # regular (non-PD) mode
    prefill_policy: str = "cache_aware"
    decode_policy: str = "least_loaded"
    worker_policy: str = "least_loaded"
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    decode_retries: int = 1                    # another decode engine, same KV, before the first byte
    retries: int = 1                           # a new prefill + decode pair when the prefill surely holds nothing
    retry_backoff: float = 0.02                # base of the exponential backoff (jittered) between tries
    breaker_open_s: float = 5.0                # an open circuit keeps a worker out this long
    session_header: str = "X-Session-Id"
    health_interval: float = 2.0
    unhealthy_after: int = 2
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    etcd: EtcdConfig | None = None             # set: workers come from etcd, not from flags
    registry_ttl: int = 10                     # lease TTL of this replica's `mesh/<id>` key
    advertise_url: str = ""                    # this replica's URL as other parties should see it
    admin_token: str | None = None             # set: admin routes need `Authorization: Bearer <it>`
    mesh_id: str = ""                          # stable across restarts (adoption of held KV); default host+port
    ledger_grace: float = 5.0                  # a transfer still held this long after decode is reclaimed
    ledger_interval: float = 0.5               # reconciliation with the pipelines' /kv/held
    kv_leak_after: float = 120.0               # blocks a worker's census leaves unaccounted this long: leak alarm
    first_token_early: bool = True             # PD streams: send the prefill's token before decode starts
    admission: AdmissionConfig = AdmissionConfig()
    api_keys: tuple[str, ...] = ()             # set: /v1/* needs `Authorization: Bearer <one of them>`
    forward_client_auth: bool = False          # pass the client's Authorization on to workers without a key of their own
    pace_us: int = 1000                        # bursty streams, dense answers: a poll per period (mesh.pacer); 0: off

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.decode_retries < 0 or self.retries < 0:
            raise ConfigError("decode_retries and retries must be >= 0")
        if self.retry_backoff < 0 or self.breaker_open_s <= 0:
            raise ConfigError("retry_backoff must be >= 0 and breaker_open_s > 0")
        if self.health_interval <= 0:
            raise ConfigError("health_interval must be > 0")
        if self.unhealthy_after < 1:
            raise ConfigError("unhealthy_after must be >= 1")
        if self.workers and (self.prefill or self.decode):
            raise ConfigError("workers (regular mode) and prefill/decode (PD mode) are exclusive")
        if self.etcd is not None and (self.prefill or self.decode or self.workers):
            raise ConfigError("with etcd the workers come from the registry: drop the worker flags")
        if self.ledger_grace <= 0 or self.ledger_interval <= 0 or self.kv_leak_after <= 0:
            raise ConfigError("ledger_grace, ledger_interval and kv_leak_after must be > 0")
        if isinstance(self.pace_us, bool) or not isinstance(self.pace_us, int) or not 0 <= self.pace_us <= 10_000:
            raise ConfigError(f"pace_us must be an integer in 0..10000 (0: off), got {self.pace_us!r}")
        if any(len(k) < 16 for k in self.api_keys):
            raise ConfigError("api keys must be at least 16 characters")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ConfigError("admin_token must be at least 16 characters")
        ids = [w.id for w in (*self.prefill, *self.decode, *self.workers)]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ConfigError(f"duplicate worker id(s): {', '.join(sorted(dup))}")

    @property
    def pd(self) -> bool:
        return not self.workers


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r}: {e}") from None


def workers_from(doc: dict[str, Any], prefill_urls: list[str], decode_urls: list[str],
                 worker_urls: list[str]) -> dict[str, tuple[Worker, ...]]:
    """Static workers from a TOML document plus URL flags."""
    out: dict[str, tuple[Worker, ...]] = {}
    for role, table, urls in (("prefill", "prefill", prefill_urls), ("decode", "decode", decode_urls),
                              ("worker", "worker", worker_urls)):
        specs = list(doc.get(table, []))
        if not all(isinstance(s, dict) for s in specs):
            raise ConfigError(f"[[{table}]] entries must be tables")
        specs += [{"url": u} for u in urls]
        out[role] = tuple(make_worker(role, s, i) for i, s in enumerate(specs))
    return out
