"""Immutable views of the fleet that routing policies read, and the static worker a TOML table or
a `mesh register` flag describes (`make_worker`).

The registry produces `Worker`s; the mesh combines them with health into a `RoutingTable`
(rebuilt whenever membership or health changes, never per request) and hands a policy a
`View`: the healthy candidates for one role and model plus the mesh's in-flight counts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Mapping, Union
from urllib.parse import urlsplit

from contract.dialects import check_dialect
from contract.errors import ConfigError, ProtocolError
from contract.protocol import DecodeRecord, PrefillRecord, check_capabilities

Role = Literal["prefill", "decode", "worker"]
Record = Union[PrefillRecord, DecodeRecord]


def split_url(url: str) -> tuple[str, int, bool, str]:
    """'http://h:1/x' -> ('h', 1, False, '/x')."""
    scheme, _, rest = url.partition("://")
    hostport, _, path = rest.partition("/")
    tls = scheme == "https"
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        host, port = hostport, ("443" if tls else "80")
    return host.strip("[]"), int(port), tls, "/" + path if path else ""


@dataclass(frozen=True, slots=True)
class Worker:
    """One routable unit: a prefill pipeline, a decode engine, or a regular worker."""
    id: str
    role: Role
    url: str
    model: str
    record: Record
    host: str = field(init=False, compare=False)
    port: int = field(init=False, compare=False)
    tls: bool = field(init=False, compare=False)
    auth: dict[str, str] = field(init=False, compare=False, repr=False)   # headers every call to it carries

    def __post_init__(self) -> None:
        host, port, tls, _ = split_url(self.url)
        object.__setattr__(self, "host", host)
        object.__setattr__(self, "port", port)
        object.__setattr__(self, "tls", tls)
        env = getattr(self.record, "api_key_env", "")
        key = os.environ.get(env, "") if env else ""
        object.__setattr__(self, "auth", {"Authorization": f"Bearer {key}"} if key else {})

    def has(self, capability: str) -> bool:
        """docs/protocol.md section 8: does the worker declare `capability`?"""
        return capability in self.record.capabilities


@dataclass(frozen=True, slots=True)
class View:
    """What a policy sees for one decision: candidates (never empty), in-flight counts, free KV."""
    workers: tuple[Worker, ...]
    load: Mapping[str, int]  # worker id -> in-flight requests on it (read-only)
    kv_free: Mapping[str, int] = field(default_factory=dict)  # pipeline id -> free KV blocks (estimate)


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """Healthy, non-draining workers grouped by (role, model); built off the request path.

    PD pairs a pipeline only with decode engines of its own dialect: a prefill pipeline is a
    candidate only while a decode engine of its model and dialect is, and decode candidates are
    also grouped by (model, dialect)."""
    by_role_model: Mapping[tuple[str, str], tuple[Worker, ...]] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    all_workers: tuple[Worker, ...] = ()
    decode_by_dialect: Mapping[tuple[str, str], tuple[Worker, ...]] = field(default_factory=dict)

    @classmethod
    def build(cls, workers: tuple[Worker, ...], healthy: frozenset[str]) -> "RoutingTable":
        live = [w for w in workers if w.id in healthy and not w.record.draining and w.model]
        dec: dict[tuple[str, str], list[Worker]] = {}
        for w in live:
            if w.role == "decode":
                dec.setdefault((w.model, w.record.dialect), []).append(w)
        groups: dict[tuple[str, str], list[Worker]] = {}
        for w in live:
            if w.role == "prefill" and (w.model, w.record.dialect) not in dec and any(
                    m == w.model for m, _ in dec):
                continue  # decode engines of this model exist, none speaks this pipeline's dialect
            groups.setdefault((w.role, w.model), []).append(w)
        models = sorted({w.model for w in workers if w.model})
        return cls(MappingProxyType({k: tuple(v) for k, v in groups.items()}), tuple(models), workers,
                   MappingProxyType({k: tuple(v) for k, v in dec.items()}))

    def candidates(self, role: str, model: str, dialect: str | None = None) -> tuple[Worker, ...]:
        if dialect is not None and role == "decode":
            return self.decode_by_dialect.get((model, dialect), ())
        return self.by_role_model.get((role, model), ())


def _check_url(url: Any, where: str) -> str:
    if not isinstance(url, str):
        raise ConfigError(f"{where}.url must be a string")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}.url must be an http(s) URL with a host, got {url!r}")
    try:
        _ = parts.port  # the property raises on a bad port
    except ValueError:
        raise ConfigError(f"{where}.url has a bad port: {url!r}") from None
    return url.rstrip("/")


def make_worker(role: str, spec: dict[str, Any], index: int, *, here: bool = True) -> Worker:
    """A static worker from a TOML table or a bare `--prefill URL` flag (`here`: the mesh that routes
    to it runs in this process, so an `api_key_env` must be set here)."""
    where = f"{role}[{index}]"
    url = _check_url(spec.get("url"), where)
    data = {"id": f"{role}-{index}", "model": "", **spec, "url": url}
    cls = PrefillRecord if role == "prefill" else DecodeRecord
    try:
        record = cls.decode(data, where)
        check_dialect(record.dialect, f"{where}.dialect")
        check_capabilities(record.capabilities, f"{where}.capabilities")
        if here and record.api_key_env and not os.environ.get(record.api_key_env):
            raise ProtocolError(f"{where}.api_key_env: the environment variable {record.api_key_env!r} is not set",
                                param=f"{where}.api_key_env")
        if getattr(record, "dp_size", 1) < 1 or record.tp_size < 1:
            raise ProtocolError(f"{where}: tp_size and dp_size must be >= 1", param=f"{where}.dp_size")
    except ProtocolError as e:
        raise ConfigError(str(e)) from None
    # (type: ignore below) role was checked by the caller's table: one of the Role names
    return Worker(id=record.id, role=role, url=url, model=record.model, record=record)  # type: ignore[arg-type]
