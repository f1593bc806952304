"""etcd users and roles for an Atomesh cluster (`mesh etcd-auth`; deploy/k8s runs it as a Job):
workers write their own keys, meshes read the fleet and write only their own record.

- role `atomesh-worker`: read the cluster's keys (a worker watches its own), read-write
  `<prefix>/<cluster>/prefill/` and `.../decode/` (records and stage liveness keys);
- role `atomesh-mesh`: read the cluster's keys, read-write `.../mesh/` (its replica record);
- `root` (etcd wants it before auth is enabled) with the root role.
Then auth is enabled. Idempotent: what exists already is kept (its password is not changed).
Passwords come from environment variables, never the command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aetcd
from aetcd import rpc

from contract.errors import ConfigError
from contract.etcd import EtcdConfig, open_client

WORKER_ROLE = "atomesh-worker"
MESH_ROLE = "atomesh-mesh"


def range_end(prefix: bytes) -> bytes:
    """etcd's end of the key range of everything under `prefix` (etcdctl --prefix)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"


@dataclass(frozen=True, slots=True)
class AuthPlan:
    root_password: str
    mesh_user: str
    mesh_password: str
    worker_user: str
    worker_password: str

    def __post_init__(self) -> None:
        for name in ("root_password", "mesh_password", "worker_password"):
            if len(getattr(self, name)) < 12:
                raise ConfigError(f"{name.replace('_', ' ')} must be at least 12 characters")
        if not self.mesh_user or not self.worker_user or self.mesh_user == self.worker_user \
                or "root" in (self.mesh_user, self.worker_user):
            raise ConfigError("the mesh and worker users must be two names other than root")

    def permissions(self, cfg: EtcdConfig) -> dict[str, list[tuple[int, bytes]]]:
        """role -> [(permission type, key prefix)]: READ = 0, WRITE = 1, READWRITE = 2."""
        root = cfg.keys.root.encode()
        return {WORKER_ROLE: [(0, root), (2, root + b"prefill/"), (2, root + b"decode/")],
                MESH_ROLE: [(0, root), (2, root + b"mesh/")]}


async def setup(cfg: EtcdConfig, plan: AuthPlan) -> list[str]:
    """Create the roles and users, enable auth; what was done, one line each. Connects as `cfg`
    says (no credentials while auth is off); on a cluster whose auth is on already, as root."""
    import dataclasses

    try:
        return await _setup(cfg, plan)
    except _AuthOn:
        return await _setup(dataclasses.replace(cfg, username="root", password=plan.root_password), plan)


class _AuthOn(Exception):
    pass


async def _setup(cfg: EtcdConfig, plan: AuthPlan) -> list[str]:
    done: list[str] = []
    client = open_client(cfg)
    try:
        await client.connect()
        stub = rpc.AuthStub(client.channel)
        md = client.metadata

        async def call(method: str, req: object, what: str) -> None:
            try:
                await getattr(stub, method)(req, timeout=cfg.timeout, metadata=md)
                done.append(what)
            except rpc.AioRpcError as e:
                detail = e.details() or ""
                if "already" in detail:   # "user name already exists", "role name already exists", ...
                    return
                if cfg.username is None and ("user name is empty" in detail or "permission denied" in detail):
                    raise _AuthOn() from None
                raise ConfigError(f"etcd refused {what}: {e.details()}") from None

        async def get(method: str, req: object) -> Any:
            try:
                return await getattr(stub, method)(req, timeout=cfg.timeout, metadata=md)
            except rpc.AioRpcError as e:
                detail = e.details() or ""
                if "not found" in detail:
                    return None
                if cfg.username is None and ("user name is empty" in detail or "permission denied" in detail):
                    raise _AuthOn() from None
                raise ConfigError(f"etcd refused {method}: {detail}") from None

        async def user(name: str, password: str, role: str) -> None:
            got = await get("UserGet", rpc.AuthUserGetRequest(name=name))
            if got is None:
                await call("UserAdd", rpc.AuthUserAddRequest(name=name, password=password), f"user {name}")
            if got is None or role not in got.roles:
                await call("UserGrantRole", rpc.AuthUserGrantRoleRequest(user=name, role=role),
                           f"role {role} to {name}")

        try:   # etcd >= 3.5; on 3.4, auth is on exactly when this run had to log in as root
            enabled = bool((await stub.AuthStatus(rpc.AuthStatusRequest(), timeout=cfg.timeout, metadata=md)).enabled)
        except rpc.AioRpcError as e:
            if "unknown method" not in (e.details() or ""):
                raise
            enabled = cfg.username is not None
        await user("root", plan.root_password, "root")
        for role, perms in plan.permissions(cfg).items():
            got = await get("RoleGet", rpc.AuthRoleGetRequest(role=role))
            if got is None:
                await call("RoleAdd", rpc.AuthRoleAddRequest(name=role), f"role {role}")
            have = {(p.permType, p.key, p.range_end) for p in (got.perm if got is not None else ())}
            for kind, key in perms:
                if (kind, key, range_end(key)) in have:
                    continue
                perm = rpc.Permission(permType=kind, key=key, range_end=range_end(key))
                await call("RoleGrantPermission", rpc.AuthRoleGrantPermissionRequest(name=role, perm=perm),
                           f"role {role}: {('read', 'write', 'readwrite')[kind]} {key.decode()}*")
        await user(plan.mesh_user, plan.mesh_password, MESH_ROLE)
        await user(plan.worker_user, plan.worker_password, WORKER_ROLE)
        if not enabled:
            await call("AuthEnable", rpc.AuthEnableRequest(), "auth enabled")
    except aetcd.ClientError as e:
        raise ConfigError(f"cannot reach etcd at {cfg.endpoints}: {e}") from None
    finally:
        await client.close()
    return done
