"""etcd access shared by the mesh (registry) and the workers (enrollment).

`EtcdConfig` is the frozen connection configuration (endpoints, prefix, cluster, auth, TLS);
`open_client` builds an `aetcd.Client` for it (with a TLS channel when CA/cert/key are set:
aetcd itself only opens insecure channels); `Keys` names every key of docs/protocol.md section 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aetcd
from aetcd import rpc

from contract.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EtcdConfig:
    endpoints: tuple[str, ...] = ("http://127.0.0.1:2379",)
    prefix: str = "/atomesh/v1"
    cluster: str = "default"
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    timeout: float = 5.0          # one etcd call

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("etcd endpoints must not be empty")
        for e in self.endpoints:
            p = urlsplit(e if "://" in e else f"http://{e}")
            if not p.hostname or not p.port:
                raise ConfigError(f"etcd endpoint must be host:port or a URL with a port, got {e!r}")
        if (self.username is None) != (self.password is None):
            raise ConfigError("etcd username and password go together")
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("etcd cert_file and key_file go together")
        if not self.cluster or "/" in self.cluster:
            raise ConfigError(f"etcd cluster must be a non-empty name without '/', got {self.cluster!r}")
        if self.timeout <= 0:
            raise ConfigError("etcd timeout must be > 0")

    @classmethod
    def from_url(cls, urls: str, **kw: Any) -> "EtcdConfig":
        """`--etcd http://h1:2379,http://h2:2379` plus options."""
        return cls(endpoints=tuple(u.strip() for u in urls.split(",") if u.strip()), **kw)

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file) or any(e.startswith("https://") for e in self.endpoints)

    def host_port(self, i: int = 0) -> tuple[str, int]:
        e = self.endpoints[i % len(self.endpoints)]
        p = urlsplit(e if "://" in e else f"http://{e}")
        return p.hostname or "127.0.0.1", int(p.port or 2379)

    @property
    def keys(self) -> "Keys":
        return Keys(f"{self.prefix.rstrip('/')}/{self.cluster}/")


@dataclass(frozen=True, slots=True)
class Keys:
    root: str

    def prefill(self, pipeline_id: str) -> bytes:
        return f"{self.root}prefill/{pipeline_id}".encode()

    def stage(self, pipeline_id: str, pp_rank: int) -> bytes:
        return f"{self.root}prefill/{pipeline_id}/stage/{pp_rank}".encode()

    def decode(self, engine_id: str) -> bytes:
        return f"{self.root}decode/{engine_id}".encode()

    def mesh(self, mesh_id: str) -> bytes:
        return f"{self.root}mesh/{mesh_id}".encode()

    def parse(self, key: bytes) -> tuple[str, str, int | None] | None:
        """('prefill'|'stage'|'decode'|'mesh', id, pp_rank) for a key under the root, else None."""
        k = key.decode("utf-8", "replace")
        if not k.startswith(self.root):
            return None
        parts = k[len(self.root):].split("/")
        if len(parts) == 2 and parts[0] in ("prefill", "decode", "mesh") and parts[1]:
            return parts[0], parts[1], None
        if len(parts) == 4 and parts[0] == "prefill" and parts[2] == "stage" and parts[3].isdigit():
            return "stage", parts[1], int(parts[3])
        return None


class _TLSClient(aetcd.Client):  # type: ignore[misc]  # aetcd ships no type information
    """aetcd.Client that opens a TLS channel (aetcd 1.0 only knows insecure ones)."""

    def __init__(self, *a: Any, credentials: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._credentials = credentials

    async def connect(self) -> None:
        """aetcd's connect, with `secure_channel` (kept in step with aetcd 1.0.0)."""
        if self._connected.is_set():
            return
        self.channel = rpc.secure_channel(f"{self._host}:{self._port}", self._credentials,
                                          options=self._options.items())
        if self._username is not None:
            self.auth_stub = rpc.AuthStub(self.channel)
            try:
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
            except rpc.AioRpcError as e:
                aetcd.exceptions._handle_exception(e)
            self.metadata = (("token", resp.token),)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                              metadata=self.metadata)
        self._connected.set()


def open_client(cfg: EtcdConfig, endpoint: int = 0) -> aetcd.Client:
    """A client for one of the endpoints (callers rotate `endpoint` on failure)."""
    host, port = cfg.host_port(endpoint)
    kw: dict[str, Any] = dict(host=host, port=port, username=cfg.username, password=cfg.password,
                              timeout=cfg.timeout)
    if not cfg.tls:
        return aetcd.Client(**kw)
    import grpc  # type: ignore[import-untyped]  # grpcio ships no type information

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e}") from None

    creds = grpc.ssl_channel_credentials(root_certificates=read(cfg.ca_file), private_key=read(cfg.key_file),
                                         certificate_chain=read(cfg.cert_file))
    return _TLSClient(credentials=creds, **kw)
